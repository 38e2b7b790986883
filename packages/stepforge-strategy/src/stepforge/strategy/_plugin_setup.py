# SPDX-License-Identifier: Apache-2.0
"""How a :class:`~stepforge.strategy.Booster` gets its plugin: built from a name or a dict (with the Booster's
``device`` where the plugin takes one) and given the Booster's mixed precision when it applies precision itself."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch

from stepforge.core import PLUGINS, Plugin

from ._env import get_world_size
from .mixed_precision import MixedPrecision

__all__ = ["adopt_precision", "build_plugin"]


def _accepts(cls: Any, name: str) -> bool:
    """Whether ``cls``'s constructor takes ``name``: named in its signature, or passed by its ``**kwargs`` to the
    next constructor up that names it (``Zero2Plugin(**kwargs)`` ends in ColossalAI's ``LowLevelZeroPlugin``
    signature, which has no ``device``)."""
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
    """The plugin of ``Booster(plugin=...)``: a registry name, a dict with ``type`` and its arguments, or an
    instance; ``None`` is ``torch_ddp`` under a process group of several ranks, else ``single``. ``device``
    reaches a plugin built here when its constructor takes it, and is checked against one that does not."""
    if plugin is None:
        plugin = "torch_ddp" if get_world_size() > 1 else "single"
    if isinstance(plugin, str | Mapping):
        kwargs: dict[str, Any] = {}
        if isinstance(plugin, Mapping):
            kwargs = dict(plugin)
            name = kwargs.pop("type", None)
            if not isinstance(name, str):
                raise ValueError(f"Booster: a plugin dict needs a 'type' name, got {dict(plugin)!r}.")
        else:
            name = plugin
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
    if plugin.explicit_precision:
        if wanted != plugin.precision:
            raise ValueError(
                f"Booster: mixed_precision={_show(mixed_precision)} conflicts with the precision "
                f"{plugin.precision!r} of plugin {plugin.name!r}, which applies precision itself; set one of "
                "them, or the same value on both."
            )
        return
    supported = plugin.supported_precisions()
    if wanted not in supported:
        raise ValueError(
            f"Booster: plugin {plugin.name!r} applies precision itself and takes {'/'.join(supported)}; "
            f"mixed_precision={_show(mixed_precision)} is not one of them."
        )
    plugin.set_precision(wanted)


def _show(spec: Any) -> str:
    return repr(spec if not isinstance(spec, MixedPrecision) else spec.name)
