# SPDX-License-Identifier: Apache-2.0
"""How a :class:`~stepforge.strategy.Booster` gets its plugin, and for ``plugin="auto"``/``memory_budget`` the
choice (or the budget check) made at ``boost``, before the model is moved or sharded."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from stepforge.core import PLUGINS, Plugin

from ._env import get_rank, get_world_size, is_distributed
from .memory._auto import AUTO_CANDIDATES, AutoChoice, check_budget, choose_plugin, memory_budget
from .mixed_precision import MixedPrecision

__all__ = [
    "PendingAutoPlugin",
    "adopt_precision",
    "auto_candidates",
    "build_plugin",
    "resolve_at_boost",
]

#: ``auto`` candidates that need no process group (one process without ``torch.distributed``)
_WITHOUT_GROUP = ("single", "zero1", "zero2", "zero2:cpu_offload=True")


def _accepts(cls: Any, name: str) -> bool:
    """Whether ``cls``'s constructor takes ``name``, itself or through ``**kwargs`` passed up to a
    parent's."""
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return False
    if name in params:
        return True
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return False
    parent = next((b for b in cls.__mro__[1:] if "__init__" in vars(b)), object)
    return parent is not object and _accepts(parent, name)


def build_plugin(plugin: Any, device: Any) -> Plugin:
    """The plugin of ``Booster(plugin=...)`` (``None``: ``torch_ddp`` under several ranks, else
    ``single``); ``device`` reaches a plugin built here when its constructor takes it, else is checked
    against its device."""
    if plugin is None:
        plugin = "torch_ddp" if get_world_size() > 1 else "single"
    if isinstance(plugin, str | Mapping):
        kwargs: dict[str, Any] = dict(plugin) if isinstance(plugin, Mapping) else {"type": plugin}
        name = kwargs.pop("type", None)
        if not isinstance(name, str):
            raise ValueError(f"Booster: a plugin dict needs a 'type' name, got {plugin!r}.")
        cls = PLUGINS.get(name)
        if device is not None and "device" not in kwargs and _accepts(cls, "device"):
            kwargs["device"] = device
        plugin = cls(**kwargs)
        if device is not None and torch.device(device).type != plugin.device.type:
            raise ValueError(
                f"Booster: device={str(device)!r}, but plugin {name!r} takes no device argument and places the "
                f"model on {plugin.device} (cuda:LOCAL_RANK when a GPU is visible, else the CPU); for a CPU "
                "run on a GPU machine hide the GPUs (CUDA_VISIBLE_DEVICES=''), or leave device out."
            )
    if not isinstance(plugin, Plugin):
        raise TypeError(
            "Booster: plugin must be a name, a dict with 'type', or an instance of a subclass of "
            f"stepforge.core.Plugin (a class with name and prepare); got {type(plugin).__name__}."
        )
    return plugin


def adopt_precision(plugin: Plugin, mixed_precision: Any, wanted: str | None) -> None:
    """Give a precision-controlling ``plugin`` the Booster's ``mixed_precision`` (named ``wanted``), or refuse a
    conflict."""
    if wanted is None:
        return
    shown = repr(mixed_precision.name if isinstance(mixed_precision, MixedPrecision) else mixed_precision)
    if plugin.explicit_precision:
        if wanted != plugin.precision:
            raise ValueError(
                f"Booster: mixed_precision={shown} conflicts with the precision "
                f"{plugin.precision!r} of plugin {plugin.name!r}, which applies precision itself; set one of "
                "them, or the same value on both."
            )
        return
    supported = plugin.supported_precisions()
    if wanted not in supported:
        raise ValueError(
            f"Booster: plugin {plugin.name!r} applies precision itself and takes {'/'.join(supported)}; "
            f"mixed_precision={shown} is not one of them."
        )
    plugin.set_precision(wanted)


def auto_candidates(plugin: Any) -> tuple[str, ...] | None:
    """The candidates of an ``auto`` spec (``"auto"``, or ``dict(type="auto", candidates=[...])``, which narrows
    them); ``None`` when ``plugin`` is not ``auto``."""
    if isinstance(plugin, str):
        return AUTO_CANDIDATES if plugin == "auto" else None
    if not isinstance(plugin, Mapping) or plugin.get("type") != "auto":
        return None
    extra = sorted(set(plugin) - {"type", "candidates"})
    if extra:
        raise ValueError(f"plugin='auto' takes only 'candidates', got {', '.join(map(repr, extra))}.")
    return AUTO_CANDIDATES if plugin.get("candidates") is None else tuple(plugin["candidates"])


class PendingAutoPlugin(Plugin):
    """Stands for the plugin ``auto`` chooses at ``boost``: it has that plugin's device and prepares
    nothing."""

    name = "auto"

    def prepare(self, model: nn.Module, optimizer: Any = None, **kwargs: Any) -> Any:
        raise RuntimeError("plugin='auto' chooses the plugin in Booster.boost; call boost, not prepare.")


def resolve_at_boost(
    plugin: Plugin,
    auto: tuple[str, ...] | None,
    budget_spec: Mapping[str, Any] | None,
    model: nn.Module,
    optimizer: Any,
    precision: str | None,
    accumulation_steps: int | None = None,
) -> AutoChoice | None:
    """For ``auto`` (its candidates): the choice; for an explicit plugin with a budget: ``None`` once it fits.
    Raises ``MemoryBudgetError`` naming what would fit."""
    device = plugin.device
    budget = memory_budget(budget_spec, device, accumulation_steps=accumulation_steps)
    world: dict[str, Any] = dict(
        world_size=get_world_size(),
        rank=get_rank(),
        backend=str(dist.get_backend()) if is_distributed() else None,
    )
    if auto is None:
        check_budget(
            plugin, model, precision=precision, optimizer=optimizer, device=device, budget=budget, **world
        )
        return None
    candidates = auto if is_distributed() else tuple(c for c in auto if c in _WITHOUT_GROUP)
    return choose_plugin(
        model,
        precision=precision,
        optimizer=optimizer,
        device=device,
        budget=budget,
        candidates=candidates,
        **world,
    )
