# SPDX-License-Identifier: Apache-2.0
"""What a plugin will hold per rank and move per step, described before anything is allocated.

:meth:`stepforge.core.Plugin.memory_plan` returns a :class:`MemoryPlan`: every kind of tensor the plugin keeps on
one rank (:class:`PlannedTensor`: which component, on the device or the host, how many bytes, from when on) and
every collective it runs in one optimizer step (:class:`PlannedCollective`). Each plugin builds its plan from its
own layout code (partitioning, padding, buckets, what is offloaded), so the plan and the implementation share
one source; ``stepforge.strategy.estimate`` adds activations and the peak on top.

Optimizer state bytes come from the optimizer itself (:class:`OptimizerStateProbe`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from ._state_probe import OptimizerStateProbe, optimizer_state_probe

__all__ = [
    "COMPONENTS",
    "PLACES",
    "LIFETIMES",
    "COLLECTIVE_OPS",
    "PlannedTensor",
    "PlannedCollective",
    "GatheredUnit",
    "MemoryPlan",
    "OptimizerStateProbe",
    "optimizer_state_probe",
    "unique_parameters",
    "tensor_bytes",
    "replicated_plan",
    "add_optimizer_state",
    "check_accumulation_steps",
    "summed_grads_lifetime",
]

#: the memory components of a plan and of an estimate, in table order
COMPONENTS = ("params", "grads", "master", "optimizer_state", "buffers", "activations")
#: ``"device"``: memory on the plugin's device; ``"host"``: CPU memory besides it (offloaded state, pinned and
#: staging buffers). On a CPU device the process holds both.
PLACES = ("device", "host")
#: when a planned tensor exists:
#:
#: - ``"boost"``: from ``boost`` (``prepare``) on;
#: - ``"step"``: from the first step on (optimizer state, gradient pieces and buffers kept between steps);
#: - ``"grads"``: from the backward until ``zero_grad`` (gradients a plugin keeps in ``param.grad``);
#: - ``"compute"``: throughout forward and backward (gathered parameters);
#: - ``"reduce"``: in backward, while gradients are reduced (buckets in flight, gradients waiting for their
#:   bucket, unsharded gradients): they grow as the activations are freed, so the peak takes the larger of the
#:   two;
#: - ``"update"``: only inside ``optimizer.step()`` (gather tables, temporaries of the update);
#:
#: and, in a plan for gradient accumulation (``accumulation_steps > 1``: each optimizer step takes several
#: micro-batches, all but the last run under the plugin's ``no_sync`` where it has one, as
#: ``ColossalAIOptimWrapper`` runs them):
#:
#: - ``"window"``: from a window's first backward until its last backward reduces them: gradients kept local
#:   under ``no_sync`` (ZeRO's full ``param.grad``, FSDP2's unsharded gradients); gone after the step;
#: - ``"accumulated"``: from a window's first backward until ``zero_grad``: gradients summed in place over the
#:   window (a replicated ``param.grad``, shards reduced every micro-batch); held after the step as ``"grads"``.
#:
#: Both live through the forward and backward of the window's later micro-batches.
LIFETIMES = ("boost", "step", "grads", "compute", "reduce", "update", "window", "accumulated")
#: the collectives a plan may list
COLLECTIVE_OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all")


@dataclass(frozen=True)
class PlannedTensor:
    """Bytes (padding included) of one kind of tensor on this rank: ``component`` is one of :data:`COMPONENTS`
    but ``"activations"`` (the estimate traces those), ``place`` one of :data:`PLACES`, ``lifetime`` one of
    :data:`LIFETIMES`; ``label`` says what it is for tables and logs (``"fp32 master pieces"``); ``pinned``:
    page-locked host memory."""

    component: str
    place: str
    nbytes: int
    label: str
    lifetime: str = "boost"
    pinned: bool = False

    def __post_init__(self) -> None:
        if self.component not in COMPONENTS[:-1]:
            raise ValueError(
                f"PlannedTensor: component must be one of {COMPONENTS[:-1]}, got {self.component!r}."
            )
        if self.place not in PLACES:
            raise ValueError(f"PlannedTensor: place must be one of {PLACES}, got {self.place!r}.")
        if self.lifetime not in LIFETIMES:
            raise ValueError(f"PlannedTensor: lifetime must be one of {LIFETIMES}, got {self.lifetime!r}.")
        if self.nbytes < 0:
            raise ValueError(f"PlannedTensor: nbytes must be >= 0, got {self.nbytes}.")


@dataclass(frozen=True)
class PlannedCollective:
    """The ``calls`` of one collective (``op``, one of :data:`COLLECTIVE_OPS`) in one optimizer step on this rank,
    in ``phase`` ``"forward"``, ``"backward"`` or ``"step"``, among ``group_size`` ranks each. ``nbytes``: their
    payload together, the full buffer each call works on (an all-reduce's tensor, a reduce-scatter's input, an
    all-gather's output, a broadcast's tensor, an all-to-all's input); ``label``: what travels."""

    op: str
    phase: str
    calls: int
    nbytes: int
    group_size: int
    label: str

    def __post_init__(self) -> None:
        if self.op not in COLLECTIVE_OPS:
            raise ValueError(f"PlannedCollective: op must be one of {COLLECTIVE_OPS}, got {self.op!r}.")

    @property
    def sent_bytes(self) -> int:
        """Bytes this rank sends over the network for these calls, by the bandwidth-optimal (ring) algorithm:
        an all-reduce ``2 (n-1)/n`` of its payload, a reduce-scatter, all-gather or all-to-all ``(n-1)/n``, a
        broadcast ``(n-1)/n`` (pipelined: each rank forwards what it receives)."""
        n = self.group_size
        if n <= 1:
            return 0
        factor = 2 if self.op == "all_reduce" else 1
        return factor * self.nbytes * (n - 1) // n


@dataclass(frozen=True)
class GatheredUnit:
    """One unit of a sharded layout whose parameters are gathered whole on the device for its forward and backward
    (an FSDP2 ``fully_shard`` unit); the estimate composes the peak from these and the activations traced inside
    the unit's module (:meth:`stepforge.strategy.Estimate.peak`), as the units are gathered and freed in turn.

    ``name``: its module as ``named_modules`` names it (``""``: the root, gathered from its forward until the end
    of backward). Bytes of: its ``gathered`` parameters (compute dtype); the ``gather_buffer`` all-gather output
    kept beside them in forward until the next unit is gathered (0 without an all-gather); its unsharded
    ``grads`` in backward; the ``reduce``-scatter input built from them (reduce dtype); its reduced gradient shard
    on the device (``sharded_grads``, 0 when offloaded). ``resharded``: freed after forward, gathered again.
    """

    name: str
    gathered: int
    gather_buffer: int
    grads: int
    reduce: int
    sharded_grads: int
    resharded: bool


@dataclass
class MemoryPlan:
    """Everything one ``rank`` of ``world_size`` holds (``tensors``) and communicates per optimizer step
    (``collectives``) when ``plugin`` (its registry name) prepares a model (see the module docstring).

    ``compute_dtype``: the parameters' dtype in forward/backward (``None``: their own; the Booster's autocast may
    apply). ``offloads``: the step runs on the host. ``full_grads``: backward accumulates the whole model's
    gradients in ``param.grad`` (not reduced into shards as they arrive). ``notes``: settings that shaped the
    plan, for logs. ``accumulation_steps``: micro-batches per optimizer step (:data:`LIFETIMES`). ``units``: the
    :class:`GatheredUnit` s gathered in turn for compute, in forward order, the root last (empty: the
    ``"compute"`` lifetime says what compute adds).
    """

    plugin: str
    world_size: int
    rank: int
    tensors: list[PlannedTensor] = field(default_factory=list)
    collectives: list[PlannedCollective] = field(default_factory=list)
    compute_dtype: torch.dtype | None = None
    offloads: bool = False
    full_grads: bool = False
    notes: list[str] = field(default_factory=list)
    accumulation_steps: int = 1
    units: list[GatheredUnit] = field(default_factory=list)

    def add(
        self,
        component: str,
        place: str,
        nbytes: int,
        label: str,
        lifetime: str = "boost",
        *,
        pinned: bool = False,
    ) -> None:
        """Add ``nbytes`` to the :class:`PlannedTensor` of this kind, appending it the first time (``nbytes`` 0
        is skipped)."""
        if not nbytes:
            return
        new = PlannedTensor(component, place, int(nbytes), label, lifetime, pinned)
        for i, t in enumerate(self.tensors):
            if replace(t, nbytes=new.nbytes) == new:
                self.tensors[i] = replace(t, nbytes=t.nbytes + new.nbytes)
                return
        self.tensors.append(new)

    def collective(self, op: str, phase: str, calls: int, nbytes: int, group_size: int, label: str) -> None:
        """Append a :class:`PlannedCollective` (no calls or a group of one rank is skipped)."""
        if calls and group_size > 1:
            self.collectives.append(PlannedCollective(op, phase, calls, int(nbytes), group_size, label))

    def total(
        self,
        *,
        component: str | None = None,
        place: str | None = None,
        lifetimes: Iterable[str] | None = None,
    ) -> int:
        """Bytes of the planned tensors matching every given filter."""
        allowed = set(lifetimes) if lifetimes is not None else None
        return sum(
            t.nbytes
            for t in self.tensors
            if (component is None or t.component == component)
            and (place is None or t.place == place)
            and (allowed is None or t.lifetime in allowed)
        )

    def sent_bytes(self) -> int:
        """Bytes this rank sends per optimizer step, all collectives together."""
        return sum(c.sent_bytes for c in self.collectives)


def unique_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``model``'s parameters with their first name, each once (tied weights are held once)."""
    seen: set[int] = set()
    out = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


def tensor_bytes(numel: int, dtype: torch.dtype) -> int:
    """``numel`` elements of ``dtype`` in bytes."""
    return numel * dtype.itemsize


def check_accumulation_steps(value: Any, where: str) -> int:
    """``value`` as the number of micro-batches per optimizer step.

    Raises:
        ValueError: not an int >= 1 (the message names ``where`` and the parameter).
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"{where}: accumulation_steps must be an int >= 1 (micro-batches per optimizer step), got {value!r}."
        )
    return value


def summed_grads_lifetime(accumulation_steps: int) -> str:
    """The lifetime of gradients that backward sums in place until ``zero_grad``: ``"grads"``, or
    ``"accumulated"`` when a window of several micro-batches keeps them through its later micro-batches."""
    return "accumulated" if accumulation_steps > 1 else "grads"


def replicated_plan(
    plugin: str,
    model: nn.Module,
    *,
    world_size: int,
    rank: int = 0,
    optimizer: Mapping[str, Any] | torch.optim.Optimizer | None = None,
    accumulation_steps: int = 1,
) -> MemoryPlan:
    """Every rank holds every parameter (in its own dtype), its gradient in ``param.grad`` and the optimizer's
    state for it, all on the device; the model's buffers too; nothing is communicated (``plugin``: the name the
    plan carries). Accumulating, the gradients are summed in ``param.grad`` through the window."""
    steps = check_accumulation_steps(accumulation_steps, f"{plugin}.memory_plan")
    plan = MemoryPlan(plugin, world_size, rank, full_grads=True, accumulation_steps=steps)
    params = unique_parameters(model)
    plan.add("params", "device", sum(p.numel() * p.element_size() for _, p in params), "parameters")
    trainable = [p for _, p in params if p.requires_grad]
    grads = sum(p.numel() * p.element_size() for p in trainable)
    plan.add("grads", "device", grads, "gradients", summed_grads_lifetime(steps))
    plan.add("buffers", "device", sum(b.numel() * b.element_size() for b in model.buffers()), "model buffers")
    if optimizer is not None:
        add_optimizer_state(plan, optimizer, [(tuple(p.shape), p.dtype) for p in trainable], place="device")
    return plan


def add_optimizer_state(
    plan: MemoryPlan,
    optimizer: Mapping[str, Any] | torch.optim.Optimizer,
    tensors: Sequence[tuple[tuple[int, ...], torch.dtype]],
    *,
    place: str,
) -> None:
    """Add the state ``optimizer`` (a ``build_optimizer`` config or an optimizer instance) keeps for tensors of
    these shapes and dtypes, as the optimizer itself lays it out, and the temporaries of its step; state it keeps
    on the CPU whatever the tensor's device (torch's ``step`` counters) is host memory."""
    probe = optimizer_state_probe(optimizer)
    with_param = on_host = 0
    by_dtype: dict[torch.dtype, list[int]] = {}
    for shape, dtype in tensors:
        by_dtype.setdefault(dtype, []).append(math.prod(shape))
        for state in probe.state(shape, dtype):
            if state.with_param:
                with_param += state.nbytes
            else:
                on_host += state.nbytes
    plan.add("optimizer_state", place, with_param, f"{probe.name} state", "step")
    plan.add("optimizer_state", "host", on_host, f"{probe.name} state kept on the CPU", "step")
    temporaries = sum(probe.step_temporaries(numels, dtype) for dtype, numels in by_dtype.items())
    plan.add("buffers", place, temporaries, f"{probe.name} step temporaries", "update")
