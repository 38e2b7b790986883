# SPDX-License-Identifier: Apache-2.0
"""The Booster's side of ``plugin="auto"`` and ``memory_budget``: the placeholder plugin until ``boost`` sees the
model, and the choice (or the budget check) made there, before the model is moved or sharded."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from torch import nn

from stepforge.core import Plugin

from .memory._auto import (
    AUTO_CANDIDATES,
    AutoChoice,
    MemoryBudget,
    check_budget,
    choose_plugin,
    memory_budget,
)

__all__ = ["PendingAutoPlugin", "is_auto", "auto_candidates", "resolve_at_boost"]

#: candidates that need no process group (one process without ``torch.distributed``)
_WITHOUT_GROUP = ("single", "zero1", "zero2", "zero2:cpu_offload=True")


def is_auto(plugin: Any) -> bool:
    """Whether ``plugin`` asks for ``auto`` (the name, or a dict of type ``auto``)."""
    if isinstance(plugin, str):
        return plugin == "auto"
    return isinstance(plugin, Mapping) and plugin.get("type") == "auto"


def auto_candidates(plugin: Any) -> tuple[str, ...]:
    """The candidates of an ``auto`` spec (``dict(type="auto", candidates=[...])`` narrows them)."""
    if isinstance(plugin, Mapping):
        extra = sorted(set(plugin) - {"type", "candidates"})
        if extra:
            raise ValueError(f"plugin='auto' takes only 'candidates', got {', '.join(map(repr, extra))}.")
        if plugin.get("candidates") is not None:
            return tuple(plugin["candidates"])
    return AUTO_CANDIDATES


class PendingAutoPlugin(Plugin):
    """Stands for the plugin ``auto`` will choose until ``boost`` sees the model: it has the device the chosen
    plugin will use (read before ``boost``, to place inputs) and prepares nothing."""

    name = "auto"

    def prepare(self, model: nn.Module, optimizer: Any = None, **kwargs: Any) -> Any:
        raise RuntimeError("plugin='auto' chooses the plugin in Booster.boost; call boost, not prepare.")


def _world() -> tuple[int, int, str | None]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank(), str(dist.get_backend())
    return 1, 0, None


def resolve_at_boost(
    plugin: Plugin,
    auto: tuple[str, ...] | None,
    budget_spec: Mapping[str, Any] | None,
    model: nn.Module,
    optimizer: Any,
    precision: str | None,
    accumulation_steps: int | None = None,
) -> AutoChoice | None:
    """For ``auto`` (``auto`` = its candidates): the choice (its plugin, settings, table and reason). For an
    explicit plugin with a budget: ``None`` once it is found to fit. ``accumulation_steps``: the run's
    micro-batches per optimizer step when known (``None``: the budget's ``accumulation_steps``, default 1).

    Raises:
        MemoryBudgetError: nothing fits (``auto``) or the explicit plugin does not; the message names what
            would.
    """
    device = plugin.device
    budget: MemoryBudget = memory_budget(budget_spec, device, accumulation_steps=accumulation_steps)
    world, rank, backend = _world()
    if auto is None:
        check_budget(
            plugin, model, world_size=world, precision=precision, optimizer=optimizer, device=device,
            backend=backend, budget=budget, rank=rank,
        )  # fmt: skip
        return None
    candidates = auto if dist.is_available() and dist.is_initialized() else tuple(
        c for c in auto if c in _WITHOUT_GROUP
    )  # fmt: skip
    return choose_plugin(
        model, world_size=world, precision=precision, optimizer=optimizer, device=device, backend=backend,
        budget=budget, candidates=candidates, rank=rank,
    )  # fmt: skip
