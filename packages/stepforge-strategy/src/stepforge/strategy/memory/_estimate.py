# SPDX-License-Identifier: Apache-2.0
"""``estimate``: per-rank memory and communication of a training configuration, before launch.

The plugin's own :meth:`~stepforge.core.Plugin.memory_plan` says what one rank holds and communicates (from its
partition, padding, bucket and offload code); a traced forward and backward of the example micro-batch on
fake tensors adds the activations (:mod:`._activations`); the peak combines the two by when each tensor lives
(see :meth:`Estimate.peak`). With ``accumulation_steps`` the plan describes a whole accumulation window: the
gradients each plugin keeps between micro-batches (under its ``no_sync``) live through the later micro-batches'
forward and backward, beside their activations.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from stepforge.core import PLUGINS, MemoryPlan, Plugin
from stepforge.core.memory_plan import COMPONENTS, check_accumulation_steps
from stepforge.core.precision import get_precision

from ._activations import ActivationTrace, trace_activations
from ._model import parameter_count, resolve_model
from ._table import estimate_table

__all__ = ["Estimate", "estimate", "make_plugin", "shared_traces"]

#: the lifetimes held between steps (a plan's steady state after a step, before ``zero_grad``)
HELD = ("boost", "step", "grads", "accumulated")
#: the lifetimes held between two micro-batches of an accumulation window (after a ``no_sync`` backward)
IN_WINDOW = ("boost", "step", "accumulated", "window")


@dataclass
class Estimate:
    """What one rank of a configuration holds (bytes) and communicates per optimizer step.

    Attributes:
        plugin: the plugin's registry name; ``settings``: the arguments it was built with.
        world_size, rank: the world planned for and the rank described.
        precision: the precision in effect (the plugin's own, or the Booster's mixed precision).
        optimizer: the optimizer's name (``None``: no optimizer state).
        backend: the process-group backend the plan assumed.
        parameters: the model's parameter count.
        device, host: bytes per component (:data:`~stepforge.core.memory_plan.COMPONENTS` and ``"peak"``):
            what is held between steps (after a step, before ``zero_grad``), the activations (what the traced
            forward keeps for backward; backward's temporaries count in the peak), and the peak over a step
            (see :meth:`peak`).
        after_boost: ``{"device": bytes, "host": bytes}`` held right after ``boost``.
        window: ``{"device": bytes, "host": bytes}`` held between two micro-batches of an accumulation window
            (after a backward under ``no_sync``; with one micro-batch per step, what is held before a forward).
        plan: the plugin's :class:`~stepforge.core.MemoryPlan` (its ``accumulation_steps``: micro-batches per
            optimizer step).
        activations: the activation trace (``None`` without ``inputs``); its ``method`` says how it was traced
            (``"fake"`` or ``"real"`` tensors).
        activation_checkpointing: whether the blocks were estimated recomputed in backward.
    """

    plugin: str
    settings: dict[str, Any]
    world_size: int
    rank: int
    precision: str
    optimizer: str | None
    backend: str
    parameters: int
    plan: MemoryPlan
    activations: ActivationTrace | None = None
    activation_checkpointing: bool = False
    device: dict[str, int] = field(default_factory=dict)
    host: dict[str, int] = field(default_factory=dict)
    after_boost: dict[str, int] = field(default_factory=dict)
    window: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        plan = self.plan
        for place, table in (("device", self.device), ("host", self.host)):
            for component in COMPONENTS[:-1]:
                table[component] = plan.total(component=component, place=place, lifetimes=HELD)
            table["activations"] = self._activation_bytes() if place == "device" else 0
            table["peak"] = self.peak(place)
            self.after_boost[place] = plan.total(place=place, lifetimes=("boost",))
            self.window[place] = plan.total(place=place, lifetimes=IN_WINDOW)

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per optimizer step (the plan's)."""
        return self.plan.accumulation_steps

    def _activation_bytes(self) -> int:
        return self.activations.forward if self.activations is not None else 0

    def peak(self, place: str | None) -> int:
        """The most bytes held at once on ``place`` (``None``: device and host together, one memory as on a CPU
        device) over a training step: the largest of

        - forward/backward of a step's first micro-batch: what is held from boost and the first step on, the
          tensors that live throughout compute, and the larger of the traced activations (with the gradients
          as they build up in the trace, for a replicated layout) and what backward adds as the activations
          are freed (the gradients, buckets in flight, unsharded gradients); where the plan gathers units in
          turn (FSDP2), the compute part is instead the largest over the units' forward and backward of what
          is gathered then plus the activations traced at that unit's own peak (:meth:`_units_peak`);
        - accumulating, forward/backward of a later micro-batch of the window: the same, with the gradients the
          window keeps (``"window"``, ``"accumulated"``) held throughout beside the activations;
        - the optimizer step: what is held between steps plus the update's own buffers.
        """
        plan = self.plan
        persistent = plan.total(place=place, lifetimes=("boost", "step"))
        grads = plan.total(place=place, lifetimes=("grads",))
        summed = plan.total(place=place, lifetimes=("accumulated",))
        kept = plan.total(place=place, lifetimes=("window",))
        compute = plan.total(place=place, lifetimes=("compute",))
        reduce = plan.total(place=place, lifetimes=("reduce",))
        update = plan.total(place=place, lifetimes=("update",))
        trace = self.activations if place != "host" else None
        traced = 0 if trace is None else trace.peak_with_grads if plan.full_grads else trace.peak
        acts = 0 if trace is None else trace.peak
        step = persistent + grads + summed + update
        if plan.units and place != "host":
            # the sharded gradients on the device are counted unit by unit as backward reduces them
            host_grads = grads - plan.total(place="device", lifetimes=("grads",)) if place is None else 0
            first = persistent + summed + compute + host_grads + reduce + self._units_peak(grads > 0)
            later = persistent + summed + kept + compute + reduce + self._units_peak(False)
        else:
            first = persistent + compute + max(traced, grads + summed + reduce, self._module_phases(place))
            later = persistent + summed + kept + compute + max(acts, grads + reduce)
        return max(first, step) if plan.accumulation_steps == 1 else max(first, later, step)

    def _module_phases(self, place: str | None) -> int:
        """Where gradients are reduced into pieces as backward produces them (not ``full_grads``): the most the
        activations at any module's backward peak and the gradient pieces and buffers in flight add up to, both
        counted in the share of the model's gradients the trace had built by then (with activation
        checkpointing a block's recomputed activations live beside most of the gradients)."""
        trace = self.activations if place != "host" else None
        if trace is None or self.plan.full_grads or not trace.grads:
            return 0
        plan = self.plan
        pieces = plan.total(place=place, lifetimes=("grads", "accumulated"))
        reduce = plan.total(place=place, lifetimes=("reduce",))
        return max(
            (
                int(m.backward + (pieces + reduce) * min(1.0, m.backward_grads / trace.grads))
                for m in trace.modules.values()
            ),
            default=0,
        )

    def _units_peak(self, sharded_grads: bool) -> int:
        """The most bytes forward and backward add on the device where the plan gathers units in turn (FSDP2:
        ``plan.units``, the root last), from what the trace saw alive at each unit's own peak, the units taken
        in the order the traced forward ran them. The root stays gathered throughout, and so does a unit while
        units nested in it run. In a unit's forward: its gathered parameters and the all-gather output kept
        until the next unit is gathered, with every earlier unit when units are not resharded; as its
        parameters are copied out, the all-gather output of the unit gathered before it (the root's for the
        first) beside the activations alive then (with dimension 0 padded to the world size, an all-gather
        output can outweigh the activations: a ViT's position embedding, a MoE layer's experts). In its backward:
        it and the unit gathered ahead of it (backward prefetch), the gradients the trace had built by its
        peak, those of the units already reduced counted as their shards (``sharded_grads``), and the
        reduce-scatter input of the unit reduced last (FSDP2 keeps one until the next reduce); as a resharded
        unit is copied out again for backward, its all-gather output beside that reduce-scatter input, the
        root's gradients and the activations its forward found alive. Around the
        whole-model activation peak (the head's and the loss's backward, outside every unit): the root and the
        all-gather output of the unit prefetched for backward. At the end of backward, beside every block's
        gradient shard: the root's gradients with its parameters and the last block's reduce-scatter input,
        then with its own reduce-scatter input (the root resharded), then that input and its output (the
        gradients freed)."""
        *blocks, root = self.plan.units
        trace = self.activations
        peaks = trace.modules if trace is not None else {}
        order = {u.name: peaks[u.name].order if u.name in peaks else i for i, u in enumerate(blocks)}
        blocks.sort(key=lambda u: order[u.name])
        shard = [u.sharded_grads if sharded_grads else 0 for u in blocks]
        # FSDP2's root pre-backward prefetches the unit backward runs first: its all-gather output is held,
        # not yet copied out, while the head's and the loss's backward run
        prefetched = blocks[-1].gather_buffer if blocks else 0
        # the root's post-backward reshards it, copies its gradients into its reduce-scatter input and frees
        # them before allocating the output; the input kept from the block reduced last is freed before
        kept = blocks[0].reduce if blocks else 0
        out = max(
            root.gathered + root.gather_buffer,
            root.gathered + prefetched + (trace.peak if trace is not None else 0),
            sum(shard)
            + max(
                root.gathered + root.grads + kept, root.grads + root.reduce, root.reduce + root.sharded_grads
            ),
        )
        for i, unit in enumerate(blocks):
            seen = peaks.get(unit.name)
            fwd, bwd, bwd_grads = (seen.forward, seen.backward, seen.backward_grads) if seen else (0, 0, 0)
            outer = [b for b in blocks[:i] if unit.name.startswith(b.name + ".")]
            others = [b for b in blocks[:i] if b not in outer]
            gathered = root.gathered + unit.gathered + sum(b.gathered for b in outer)
            before = (blocks[i - 1] if i else root).gather_buffer
            later = blocks[i + 1 :]
            # the reduce-scatter input of the unit reduced last is kept until the next one is reduced
            in_flight = later[0].reduce if later else 0
            grads = in_flight + (
                max(0, bwd_grads - sum(b.grads for b in later)) + sum(shard[i + 1 :]) if seen else unit.grads
            )
            entry = seen.entry if seen else 0
            earlier = 0 if unit.resharded else sum(b.gathered for b in others)
            out = max(
                out,
                gathered + unit.gather_buffer + before + entry + earlier,
                gathered + unit.gather_buffer + fwd + earlier,
                gathered + sum(b.gathered for b in (others[-1:] if unit.resharded else others)) + grads + bwd,
            )
            if unit.resharded:
                regathered = in_flight + root.grads + sum(shard[i + 1 :]) + entry
                out = max(out, gathered + unit.gather_buffer + regathered)
        return out

    @property
    def collectives(self) -> dict[str, dict[str, int]]:
        """Per collective op: ``calls``, ``bytes`` (payload) and ``sent_bytes`` (ring estimate) per step."""
        out: dict[str, dict[str, int]] = {}
        for c in self.plan.collectives:
            entry = out.setdefault(c.op, {"calls": 0, "bytes": 0, "sent_bytes": 0})
            entry["calls"] += c.calls
            entry["bytes"] += c.nbytes
            entry["sent_bytes"] += c.sent_bytes
        return out

    @property
    def sent_bytes(self) -> int:
        """Bytes this rank sends per optimizer step, every collective together."""
        return self.plan.sent_bytes()

    def fits(self, device: int | None = None, host: int | None = None) -> bool:
        """Whether the peaks fit ``device`` and ``host`` bytes (``None``: not checked)."""
        return (device is None or self.device["peak"] <= device) and (
            host is None or self.host["peak"] <= host
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: ``device``, ``host`` (bytes per component and ``peak``), ``collectives``, and the
        configuration, the state right after boost, the plan's tensors and notes."""
        return {
            "plugin": self.plugin,
            "settings": {
                k: repr(v) if not isinstance(v, int | float | str | bool) else v
                for k, v in self.settings.items()
            },
            "world_size": self.world_size,
            "rank": self.rank,
            "precision": self.precision,
            "optimizer": self.optimizer,
            "backend": self.backend,
            "parameters": self.parameters,
            "device": dict(self.device),
            "host": dict(self.host),
            "after_boost": dict(self.after_boost),
            "accumulation_steps": self.accumulation_steps,
            "window": dict(self.window),
            "collectives": self.collectives,
            "sent_bytes_per_step": self.sent_bytes,
            "activations_traced": self.activations is not None,
            "activations_method": None if self.activations is None else self.activations.method,
            "activation_checkpointing": self.activation_checkpointing,
            "tensors": [asdict(t) for t in self.plan.tensors],
            "notes": list(self.plan.notes),
        }

    def __str__(self) -> str:
        return estimate_table([self])


def _optimizer_name(optimizer: Mapping[str, Any] | torch.optim.Optimizer | None) -> str | None:
    if isinstance(optimizer, torch.optim.Optimizer):
        return type(optimizer).__name__
    kind = None if optimizer is None else optimizer.get("type")
    return kind if isinstance(kind, str) or kind is None else getattr(kind, "__name__", str(kind))


#: within :func:`shared_traces`: ``(model, inputs, trace arguments, trace)`` of the traces made so far
_TRACES: ContextVar[list[tuple[Any, Any, dict[str, Any], ActivationTrace]] | None] = ContextVar(
    "stepforge_estimate_traces", default=None
)


@contextmanager
def shared_traces() -> Iterator[None]:
    """Within it, estimates of the same model (object) and micro-batch (object) reuse one activation trace per
    set of trace arguments (compute and autocast dtype, criterion): several plugins are traced once. Nested, the
    outermost context's traces are shared."""
    token = _TRACES.set([]) if _TRACES.get() is None else None
    try:
        yield
    finally:
        if token is not None:
            _TRACES.reset(token)


def _trace(model: Any, module: nn.Module, inputs: Any, arguments: dict[str, Any]) -> ActivationTrace:
    kept = _TRACES.get()
    for seen_model, seen_inputs, seen_arguments, trace in kept or ():
        if seen_model is model and seen_inputs is inputs and seen_arguments == arguments:
            return trace
    trace = trace_activations(module, inputs, **arguments)
    if kept is not None:
        kept.append((model, inputs, arguments, trace))
    return trace


def _names_device(cls: Any) -> bool:
    """Whether ``cls`` takes ``device`` by name (a ``**kwargs`` passing it on to a base that has none does not
    count: ``Zero2Plugin``)."""
    try:
        return "device" in inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return False


def make_plugin(
    plugin: str | Mapping[str, Any] | Plugin,
    *,
    device: str | torch.device | None = None,
    precision: str | None = None,
    **plugin_kwargs: Any,
) -> tuple[Plugin, str, torch.dtype | None]:
    """``(plugin, precision in effect, autocast dtype)``: the plugin built as the Booster builds it, with
    ``precision`` adopted by a plugin that applies precision itself, or applied as the Booster's autocast.

    Raises:
        TypeError: a plugin instance together with keyword arguments, or not a plugin.
        HyperParameterError: a precision the plugin does not take.
    """
    if isinstance(plugin, Plugin):
        if plugin_kwargs:
            raise TypeError(
                "estimate: plugin arguments were given with a plugin instance; pass a name (plugin='zero2', "
                "stage=...) or configure the instance."
            )
        built = plugin
    else:
        kwargs = dict(plugin_kwargs)
        if isinstance(plugin, Mapping):
            kwargs = {**dict(plugin), **kwargs}
            name = kwargs.pop("type", None)
            if not isinstance(name, str):
                raise TypeError(f"estimate: a plugin dict needs a 'type' name, got {dict(plugin)!r}.")
        else:
            name = plugin
        cls = PLUGINS.get(name)
        if device is not None and "device" not in kwargs and _names_device(cls):
            kwargs["device"] = device
        built = cls(**kwargs)
        if not isinstance(built, Plugin):
            raise TypeError(f"estimate: {name!r} did not build a stepforge.core.Plugin.")
    autocast = None
    if built.control_precision():
        if precision is not None and not (built.explicit_precision and built.precision == precision):
            built.set_precision(precision)
        effective = str(built.precision)
    else:
        effective = get_precision(precision).name if precision is not None else "fp32"
        autocast = get_precision(effective).autocast_dtype
    return built, effective, autocast


def estimate(
    model: nn.Module | Callable[[], nn.Module] | Any,
    plugin: str | Mapping[str, Any] | Plugin = "single",
    *,
    world_size: int = 1,
    precision: str | None = None,
    optimizer: Mapping[str, Any] | torch.optim.Optimizer | None = None,
    inputs: Any = None,
    criterion: Callable[[Any], torch.Tensor] | None = None,
    rank: int = 0,
    device: str | torch.device | None = None,
    backend: str | None = None,
    accumulation_steps: int = 1,
    trace: str = "auto",
    activation_checkpointing: bool = False,
    **plugin_kwargs: Any,
) -> Estimate:
    """Per-rank memory and communication of training ``model`` with ``plugin`` on ``world_size`` ranks, before
    anything is allocated.

    ::

        est = estimate(model, plugin="zero2", world_size=1024, precision="bf16",
                       optimizer=dict(type="AdamW", lr=1e-4), inputs=batch)
        print(est)                      # a table
        est.to_dict()["device"]["peak"]

    Args:
        model: an ``nn.Module`` (real or on the meta device; not changed), a function building one (called
            under ``torch.device("meta")``) or a Hugging Face ``transformers`` config.
        plugin: a plugin name (``"zero2"``, ``"torch_fsdp"``...), a dict with ``type``, or an instance.
        world_size: the data-parallel world to plan for.
        precision: ``"fp32"``, ``"bf16"``, ``"fp16"``: the plugin's own precision, or the Booster's mixed
            precision for plugins without one (``None``: the plugin's default, fp32 for the others).
        optimizer: the ``build_optimizer`` config or the optimizer instance the run uses (``None``: no optimizer
            state). State bytes are read from the optimizer itself: a config's optimizer is built on stand-in
            parameters, an instance is copied onto them (never stepped or changed itself).
        inputs: an example micro-batch as the forward takes it (a tensor, a tuple of positional arguments or a
            dict of keyword arguments; real or meta tensors): activations are traced from it. ``None``: no
            activations.
        criterion: a function of the output returning the loss (default: the output's mean).
        rank: the rank described (0 holds the most).
        device: the device the plugin places the model on (``"cuda"``, ``"cpu"``; default: CUDA if available).
        backend: the process-group backend to plan for (default: gloo on a CPU device, nccl otherwise).
        accumulation_steps: micro-batches per optimizer step (gradient accumulation), run as
            ``ColossalAIOptimWrapper`` runs them: all but the last under the plugin's ``no_sync`` where it has
            one. The gradients each plugin keeps between micro-batches count in :attr:`Estimate.window` and the
            peak, and the collectives are those of a whole optimizer step.
        trace: how the activations are traced (:data:`~._activations.TRACE_METHODS`): ``"fake"`` on fake
            tensors (nothing allocated; a forward reading tensor values fails), ``"real"`` on real CPU tensors
            (the model in the compute dtype and one forward and backward allocated), ``"auto"`` (default) fake,
            real where the forward reads values (MoE routing) or meets an op without a fake kernel.
            :attr:`Estimate.activations` ``.method`` says which ran.
        activation_checkpointing: estimate with the model's blocks recomputed in backward (transformers'
            ``gradient_checkpointing_enable()``, else ``torch.utils.checkpoint`` around each block); a model
            that already checkpoints is estimated as it is without it.
        **plugin_kwargs: the plugin's own arguments (``stage``, ``cpu_offload``, ``placement_policy``...).

    Returns:
        An :class:`Estimate`.
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"estimate: world_size must be an int >= 1, got {world_size!r}.")
    if not 0 <= rank < world_size:
        raise ValueError(f"estimate: rank must lie in [0, world_size={world_size}), got {rank!r}.")
    check_accumulation_steps(accumulation_steps, "estimate")
    if optimizer is not None and not isinstance(optimizer, Mapping | torch.optim.Optimizer):
        raise TypeError(
            "estimate: optimizer must be a torch.optim.Optimizer, a build_optimizer config "
            f"(dict(type='AdamW', lr=1e-4)) or None, got {type(optimizer).__name__}."
        )
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    built, effective, autocast = make_plugin(plugin, device=device, precision=precision, **plugin_kwargs)
    if backend is None:
        backend = "gloo" if torch.device(device).type == "cpu" else "nccl"
    module = resolve_model(model)
    plan = built.memory_plan(
        module,
        world_size=world_size,
        rank=rank,
        optimizer=optimizer,
        backend=backend,
        device=device,
        accumulation_steps=accumulation_steps,
    )
    trace_result = None
    if inputs is not None:
        trace_result = _trace(
            model,
            module,
            inputs,
            dict(
                compute_dtype=plan.compute_dtype,
                autocast_dtype=autocast,
                criterion=criterion,
                method=trace,
                activation_checkpointing=activation_checkpointing,
            ),
        )
    settings = dict(plugin_kwargs)
    if isinstance(plugin, Mapping):
        settings = {**{k: v for k, v in plugin.items() if k != "type"}, **settings}
    return Estimate(
        plugin=built.name,
        settings=settings,
        world_size=world_size,
        rank=rank,
        precision=effective,
        optimizer=_optimizer_name(optimizer),
        backend=backend,
        parameters=parameter_count(module),
        plan=plan,
        activations=trace_result,
        activation_checkpointing=activation_checkpointing,
    )
