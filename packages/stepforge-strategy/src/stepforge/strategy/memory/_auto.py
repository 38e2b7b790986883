# SPDX-License-Identifier: Apache-2.0
"""``plugin="auto"``: the fastest plugin that fits a memory budget, chosen from the estimates before anything is
allocated; and the check of an explicit plugin against a budget.

The candidates (:data:`AUTO_CANDIDATES`) are estimated for the model, optimizer, precision and world size of the
run. Of those whose peaks fit the budget, the fastest is taken, in this documented order:

1. a plugin that steps the optimizer on the device before one that offloads it to the host (a host step reads
   and writes every state element over the CPU's memory bus);
2. fewer bytes sent per optimizer step (ring estimates of every collective);
3. less optimizer work per rank (bytes of optimizer state the rank updates).

When none fits, :class:`MemoryBudgetError` says so, with the table, and names the plugins and settings that would
fit: the smallest world size each candidate fits at, and the host memory an offloading one would need.

With gradient accumulation (``accumulation_steps`` of the budget: ``Strategy.prepare`` takes it from the optim
wrapper's ``accumulative_counts``) every candidate is estimated for the whole window: the gradients it keeps
between micro-batches count in its peak, and its bytes sent are those of one optimizer step.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from stepforge.core import OptimizerStateError, StepforgeError
from stepforge.core.memory_plan import check_accumulation_steps

from ._compare import estimate_plugins
from ._estimate import Estimate, estimate, shared_traces
from ._specs import parse_plugin, parse_size, plugin_label
from ._table import estimate_table, format_bytes

__all__ = [
    "AUTO_CANDIDATES",
    "AutoChoice",
    "MemoryBudget",
    "MemoryBudgetError",
    "choose_plugin",
    "check_budget",
    "memory_budget",
]

logger = logging.getLogger("stepforge.strategy")

#: the plugins ``auto`` chooses from (``single`` only on one rank), as ``name[:key=value,...]``
AUTO_CANDIDATES = (
    "single",
    "torch_ddp",
    "zero1",
    "zero2",
    "torch_fsdp",
    "zero2:cpu_offload=True",
    "gemini:placement_policy='auto'",
)
#: the largest world size the suggestions of :class:`MemoryBudgetError` consider
MAX_SUGGESTED_WORLD = 4096


class MemoryBudgetError(StepforgeError, RuntimeError):
    """No plugin (or not the one asked for) fits the memory budget; raised at ``boost``, before the model is
    moved or sharded."""


@dataclass(frozen=True)
class MemoryBudget:
    """Bytes one rank may use: ``device`` (its accelerator, or the process's memory on a CPU device) and
    ``host``; ``inputs`` (optional): an example micro-batch, whose traced activations then count too;
    ``accumulation_steps``: micro-batches per optimizer step the run accumulates."""

    device: int
    host: int
    inputs: Any = None
    criterion: Callable[[Any], torch.Tensor] | None = None
    accumulation_steps: int = 1

    def admits(self, est: Estimate, on_cpu: bool) -> bool:
        """Whether ``est``'s peaks fit (on a CPU device, device and host are one memory: their sum must fit
        the smaller budget)."""
        if on_cpu:
            return est.peak(None) <= min(self.device, self.host)
        return est.fits(self.device, self.host)


def _host_free() -> int:
    """The host's available memory shared by the ranks on this node (``LOCAL_WORLD_SIZE``)."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return available // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


#: the keys ``memory_budget`` takes
BUDGET_KEYS = ("device", "host", "inputs", "criterion", "accumulation_steps")


def memory_budget(
    spec: Mapping[str, Any] | None, device: torch.device, *, accumulation_steps: int | None = None
) -> MemoryBudget:
    """The budget of ``memory_budget=dict(device=..., host=..., inputs=..., criterion=..., accumulation_steps=...)``:
    sizes in bytes or as strings (``"70GiB"``); a missing one is the free memory (the device's, and the host's
    shared by the ranks of this node). ``accumulation_steps`` (default 1): micro-batches per optimizer step; the
    keyword argument of that name is the run's own count (the optim wrapper's ``accumulative_counts``), which
    the spec may repeat but not contradict.

    Raises:
        ValueError: an unknown key, a size that is not a positive number or a size string, an accumulation count
            below 1 or two that differ.
    """
    spec = dict(spec or {})
    unknown = sorted(set(spec) - set(BUDGET_KEYS))
    if unknown:
        raise ValueError(
            f"memory_budget: unknown key(s) {', '.join(map(repr, unknown))}; use {', '.join(BUDGET_KEYS)}."
        )
    steps = check_accumulation_steps(spec.get("accumulation_steps", 1), "memory_budget")
    if accumulation_steps is not None:
        given = check_accumulation_steps(accumulation_steps, "boost")
        if "accumulation_steps" in spec and steps != given:
            raise ValueError(
                f"memory_budget: accumulation_steps={steps} contradicts the run's {given} micro-batches per "
                "optimizer step (the optim wrapper's accumulative_counts); drop it from memory_budget."
            )
        steps = given

    def size(key: str, default: Callable[[], int]) -> int:
        value = spec.get(key)
        if value is None:
            return default()
        nbytes = parse_size(value) if isinstance(value, str) else value
        if isinstance(nbytes, bool) or not isinstance(nbytes, int | float) or nbytes <= 0:
            raise ValueError(
                f"memory_budget: {key} must be a positive number of bytes or a size like '70GiB', got {value!r}."
            )
        return int(nbytes)

    def device_free() -> int:
        if device.type == "cuda":
            return int(torch.cuda.mem_get_info(device)[0])
        return _host_free()

    return MemoryBudget(
        size("device", device_free),
        size("host", _host_free),
        spec.get("inputs"),
        spec.get("criterion"),
        steps,
    )


def _rank_key(est: Estimate) -> tuple[bool, int, int]:
    return est.plan.offloads, est.sent_bytes, est.plan.total(component="optimizer_state")


@dataclass
class AutoChoice:
    """The plugin ``auto`` chose and why.

    Attributes:
        plugin, settings: the chosen registry name and its arguments.
        estimates, fits: every candidate's estimate and whether it fits.
        table: the candidates side by side; reason: one sentence.
    """

    plugin: str
    settings: dict[str, Any]
    estimates: list[Estimate] = field(default_factory=list)
    fits: list[bool] = field(default_factory=list)
    table: str = ""
    reason: str = ""


def _estimates(model: nn.Module, candidates: Sequence[str], world_size: int, **kwargs: Any) -> list[Estimate]:
    """The candidates' estimates; one whose layout the optimizer cannot step (Muon's matrices on ZeRO's flat
    shards) is left out and logged, and when every one is, the first error is raised."""
    out: list[Estimate] = []
    errors: list[OptimizerStateError] = []
    with shared_traces():
        for spec in candidates:
            try:
                out += estimate_plugins(model, [spec], world_size=world_size, **kwargs)
            except OptimizerStateError as exc:
                logger.info("plugin='auto' leaves out %s: %s", spec, exc)
                errors.append(exc)
    if errors and not out:
        raise errors[0]
    return out


def _budget_text(budget: MemoryBudget, world_size: int) -> str:
    steps = budget.accumulation_steps
    window = f", {steps} micro-batches per step" if steps > 1 else ""
    return (
        f"device {format_bytes(budget.device)}, host {format_bytes(budget.host)} per rank at {world_size} ranks"
        f"{window}"
    )


def _would_fit(
    model: nn.Module,
    candidates: Sequence[str],
    world_size: int,
    budget: MemoryBudget,
    on_cpu: bool,
    **kwargs: Any,
) -> list[str]:
    """Plugins and settings that would fit: the smallest larger world size per candidate, and the host memory an
    offloading candidate that fits the device would need."""
    out = []
    with shared_traces():  # every world size and candidate traces the same micro-batch
        for spec in candidates:
            name, settings = parse_plugin(spec)
            if name == "single":
                continue
            label = plugin_label(name, settings)
            try:
                (here,) = _estimates(model, [spec], world_size, **kwargs)
            except OptimizerStateError:
                continue  # the optimizer cannot step this candidate's layout (left out of the choice)
            world = world_size * 2
            while world <= MAX_SUGGESTED_WORLD:
                (est,) = _estimates(model, [spec], world, **kwargs)
                if budget.admits(est, on_cpu):
                    out.append(f"{label} at {world} ranks")
                    break
                world *= 2
            device_fits = here.device["peak"] <= budget.device
            if not on_cpu and device_fits and here.host["peak"] > budget.host:
                out.append(f"{label} with {format_bytes(here.host['peak'])} of host memory per rank")
    return out


def choose_plugin(
    model: nn.Module,
    *,
    world_size: int,
    precision: str | None,
    optimizer: Mapping[str, Any] | torch.optim.Optimizer | None,
    device: torch.device,
    backend: str | None,
    budget: MemoryBudget,
    candidates: Sequence[str] = AUTO_CANDIDATES,
    rank: int = 0,
) -> AutoChoice:
    """The fastest candidate that fits ``budget`` (see the module docstring); logs the table and the reason.

    Raises:
        MemoryBudgetError: none fits; the message holds the table and what would fit.
    """
    kwargs: dict[str, Any] = dict(
        precision=precision, optimizer=optimizer, inputs=budget.inputs, device=str(device), backend=backend,
        rank=rank, accumulation_steps=budget.accumulation_steps,
    )  # fmt: skip
    if budget.criterion is not None:
        kwargs["criterion"] = budget.criterion
    estimates = _estimates(model, candidates, world_size, **kwargs)
    on_cpu = device.type == "cpu"
    fits = [budget.admits(e, on_cpu) for e in estimates]
    table = estimate_table(estimates, fits=fits)
    fitting = sorted((_rank_key(e), i) for i, e in enumerate(estimates) if fits[i])
    if not fitting:
        suggestions = _would_fit(model, candidates, world_size, budget, on_cpu, **kwargs)
        raise MemoryBudgetError(
            f"plugin='auto': no plugin fits the memory budget ({_budget_text(budget, world_size)}).\n{table}\n"
            + ("Would fit: " + "; ".join(suggestions) + "." if suggestions else "Nothing would fit up to "
               f"{MAX_SUGGESTED_WORLD} ranks: reduce the model or the micro-batch.")
        )  # fmt: skip
    best = estimates[fitting[0][1]]
    settings = dict(best.settings)
    offload = "steps on the host" if best.plan.offloads else "steps on the device"
    reason = (
        f"plugin='auto' chose {plugin_label(best.plugin, settings)}: its peak fits ({_budget_text(budget, world_size)}; "
        f"device peak {format_bytes(best.device['peak'])}, host peak {format_bytes(best.host['peak'])}), it "
        f"{offload} and sends {format_bytes(best.sent_bytes)} per step, the least of the {len(fitting)} that fit."
    )
    logger.info("%s\n%s", reason, table)
    return AutoChoice(best.plugin, settings, estimates, fits, table, reason)


def check_budget(
    plugin: Any,
    model: nn.Module,
    *,
    world_size: int,
    precision: str | None,
    optimizer: Mapping[str, Any] | torch.optim.Optimizer | None,
    device: torch.device,
    backend: str | None,
    budget: MemoryBudget,
    rank: int = 0,
) -> Estimate:
    """Estimate the configured ``plugin`` (an instance) and raise :class:`MemoryBudgetError` naming the plugins
    that would fit when it does not."""
    est = estimate(
        model, plugin, world_size=world_size, precision=precision, optimizer=optimizer, inputs=budget.inputs,
        criterion=budget.criterion, rank=rank, device=str(device), backend=backend,
        accumulation_steps=budget.accumulation_steps,
    )  # fmt: skip
    if budget.admits(est, device.type == "cpu"):
        return est
    try:
        choice = choose_plugin(
            model, world_size=world_size, precision=precision, optimizer=optimizer, device=device,
            backend=backend, budget=budget, rank=rank,
        )  # fmt: skip
        hint = f"{plugin_label(choice.plugin, choice.settings)} would fit ({choice.reason})"
    except MemoryBudgetError as exc:
        hint = str(exc).split("\n")[-1]
    raise MemoryBudgetError(
        f"plugin {est.plugin!r} does not fit the memory budget ({_budget_text(budget, world_size)}): device peak "
        f"{format_bytes(est.device['peak'])}, host peak {format_bytes(est.host['peak'])}.\n{est}\n{hint}"
    )
