# SPDX-License-Identifier: Apache-2.0
"""Put stepforge's optimizers, optim wrappers, schedulers and strategies into mmengine's registries.

Names. mmengine registers ColossalAI's optimizers (``CPUAdam``, ``HybridAdam``, ``FusedAdam``, ``FusedLAMB``,
``FusedSGD``, ``Lamb``, ``Lars``), its ``ColossalAIOptimWrapper``, ``AmpOptimWrapper``,
``ZeroRedundancyOptimizer`` and ``ColossalAIStrategy`` under the plain names whenever ColossalAI is installed,
so stepforge's objects are registered with a ``Stepforge`` prefix: ``StepforgeCPUAdam``, ``StepforgeLamb``,
``StepforgeZeroRedundancyOptimizer``, ``StepforgeColossalAIOptimWrapper``, ``StepforgeAmpOptimWrapper``,
``StepforgeOptimWrapper``, ``StepforgeStrategy``, ``StepforgeColossalAIStrategy``. A config then means the
same thing with or without ColossalAI installed.

Opt-in override: :func:`register_all` with ``override=True`` (what importing ``stepforge.mmengine.override``
does, e.g. from ``custom_imports``) also registers the ColossalAI names — the optimizers above, the
``ColossalAIOptimWrapper`` and the ``ColossalAIStrategy`` — with ``force=True``, replacing mmengine's
ColossalAI entries, so an existing ColossalAI config runs on stepforge unchanged. It works whatever the import
order: mmengine's own ColossalAI module is imported first (``import mmengine.runner``), so its registrations never
collide with ours. mmengine's own
``OptimWrapper``/``AmpOptimWrapper``/``ZeroRedundancyOptimizer`` are never replaced (the plain ``Runner`` and
mmengine's schedulers rely on them).

Schedulers: every name of :data:`stepforge.strategy.schedulers.SCHEDULERS` that mmengine's
``PARAM_SCHEDULERS`` lacks is registered under that name (with mmengine 0.10 none is missing: mmengine has all
of them with the same semantics).
"""

from __future__ import annotations

import importlib
from typing import Any

from mmengine.registry import MODEL_WRAPPERS, OPTIM_WRAPPERS, OPTIMIZERS, PARAM_SCHEDULERS, STRATEGIES

from stepforge.core import OPTIM_WRAPPERS as SF_OPTIM_WRAPPERS
from stepforge.core import OPTIMIZERS as SF_OPTIMIZERS
from stepforge.strategy.schedulers import SCHEDULERS as SF_SCHEDULERS

from .model_wrapper import StepforgeModelWrapper
from .strategy import StepforgeColossalAIStrategy, StepforgeStrategy

__all__ = ["PREFIX", "COLOSSALAI_NAMES", "register_all", "registered_names"]

PREFIX = "Stepforge"
#: the names of mmengine's ColossalAI entries that ``override=True`` replaces (registry -> names)
COLOSSALAI_NAMES: dict[str, tuple[str, ...]] = {
    "optimizer": ("CPUAdam", "HybridAdam", "FusedAdam", "FusedLAMB", "FusedSGD", "Lamb", "Lars"),
    "optim_wrapper": ("ColossalAIOptimWrapper",),
    "strategy": ("ColossalAIStrategy",),
}

_REGISTERED: dict[str, list[str]] = {}


def _put(registry: Any, kind: str, name: str, obj: Any) -> None:
    # force: re-importing (or register_all(override=True) after register_all()) must not fail
    registry.register_module(name=name, module=obj, force=True)
    names = _REGISTERED.setdefault(kind, [])
    if name not in names:
        names.append(name)


def _stepforge_entries(registry: Any) -> dict[str, Any]:
    """Declared name -> object for everything a stepforge distribution registered (not torch built-ins)."""
    out = {}
    for entry in registry.describe().values():
        if entry.source != "built-in":
            out[entry.name] = registry.get(entry.name)
    return out


def _import_mmengine_colossalai_entries() -> None:
    """Let mmengine register its own ColossalAI entries before ours replace them.

    mmengine's ``mmengine/_strategy/colossalai.py`` registers ``ColossalAIOptimWrapper`` and ``ColossalAIStrategy``
    without ``force`` when it is first imported, which ``import mmengine.runner`` does (through the
    ``FlexibleRunner``). Were ours registered first, that later import would fail with "already registered"; so
    the runner package is imported here, whatever the order of the user's imports, and ours go in after it.
    """
    importlib.import_module("mmengine.runner")


def register_all(*, override: bool = False) -> dict[str, list[str]]:
    """Register stepforge's objects in mmengine's registries; idempotent.

    Args:
        override: also register the ColossalAI names of :data:`COLOSSALAI_NAMES` over mmengine's entries.

    Returns:
        registry kind (``"optimizer"``, ``"optim_wrapper"``, ``"param_scheduler"``, ``"strategy"``,
        ``"model_wrapper"``) -> the names registered so far.
    """
    optimizers = _stepforge_entries(SF_OPTIMIZERS)
    wrappers = _stepforge_entries(SF_OPTIM_WRAPPERS)
    for name, cls in optimizers.items():
        _put(OPTIMIZERS, "optimizer", PREFIX + name, cls)
    for name, cls in wrappers.items():
        _put(OPTIM_WRAPPERS, "optim_wrapper", PREFIX + name, cls)
    for name, cls in SF_SCHEDULERS.items():
        if name not in PARAM_SCHEDULERS.module_dict or PARAM_SCHEDULERS.module_dict[name] is cls:
            _put(PARAM_SCHEDULERS, "param_scheduler", name, cls)
    _put(STRATEGIES, "strategy", "StepforgeStrategy", StepforgeStrategy)
    _put(STRATEGIES, "strategy", "StepforgeColossalAIStrategy", StepforgeColossalAIStrategy)
    _put(MODEL_WRAPPERS, "model_wrapper", "StepforgeModelWrapper", StepforgeModelWrapper)
    if override:
        _import_mmengine_colossalai_entries()
        for name in COLOSSALAI_NAMES["optimizer"]:
            if name in optimizers:
                _put(OPTIMIZERS, "optimizer", name, optimizers[name])
        for name in COLOSSALAI_NAMES["optim_wrapper"]:
            if name in wrappers:
                _put(OPTIM_WRAPPERS, "optim_wrapper", name, wrappers[name])
        _put(STRATEGIES, "strategy", "ColossalAIStrategy", StepforgeColossalAIStrategy)
    return registered_names()


def registered_names() -> dict[str, list[str]]:
    """What :func:`register_all` has put into mmengine's registries in this process (kind -> names)."""
    return {kind: sorted(names) for kind, names in _REGISTERED.items()}
