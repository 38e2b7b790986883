# SPDX-License-Identifier: Apache-2.0
"""Parameter schedulers from config dicts, mmengine's ``build_param_scheduler`` semantics.

- mmengine names (``LinearLR``, ``ConstantLR``, ``CosineAnnealingLR``, ``ExponentialLR``, ``MultiStepLR``,
  ``StepLR``, ``PolyLR``, ``OneCycleLR``) build this package's chainable schedulers with ``param_name="lr"``;
  ``*ParamScheduler`` names take ``param_name`` from the dict.
- Any other ``torch.optim.lr_scheduler`` class name (``PolynomialLR``, ``CosineAnnealingWarmRestarts``,
  ``LambdaLR``...) builds torch's scheduler; ``by_epoch`` (default True) is recorded on it, and ``begin``/``end``
  are refused (torch schedulers act from the first step).
- ``end`` defaults to ``max_epochs`` (``by_epoch=True``, the default) or ``max_iters``; a missing one is an error.
- ``convert_to_iter_based=True`` multiplies ``begin``/``end`` and the step-like arguments by ``epoch_length``
  and sets ``by_epoch=False``.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from stepforge.accum import OptimWrapper

from ._param import (
    ConstantParamScheduler,
    CosineAnnealingParamScheduler,
    ExponentialParamScheduler,
    LinearParamScheduler,
    MultiStepParamScheduler,
    OneCycleParamScheduler,
    ParamScheduler,
    PolyParamScheduler,
    StepParamScheduler,
)

__all__ = ["SCHEDULERS", "build_param_scheduler", "scheduler_by_epoch"]

_PARAM = {
    "Constant": ConstantParamScheduler,
    "CosineAnnealing": CosineAnnealingParamScheduler,
    "Exponential": ExponentialParamScheduler,
    "Linear": LinearParamScheduler,
    "MultiStep": MultiStepParamScheduler,
    "Step": StepParamScheduler,
    "Poly": PolyParamScheduler,
    "OneCycle": OneCycleParamScheduler,
}

#: name -> scheduler class of this package (mmengine's LR and ParamScheduler names)
SCHEDULERS: dict[str, type[ParamScheduler]] = {f"{k}ParamScheduler": v for k, v in _PARAM.items()}


def _lr_class(base: type[ParamScheduler], name: str) -> type[ParamScheduler]:
    def __init__(self: ParamScheduler, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        base.__init__(self, optimizer, "lr", *args, **kwargs)

    return type(name, (base,), {"__init__": __init__, "__doc__": f"mmengine's {name}: {base.__doc__}"})


for _short, _cls in _PARAM.items():
    SCHEDULERS[f"{_short}LR"] = _lr_class(_cls, f"{_short}LR")


def scheduler_by_epoch(scheduler: Any) -> bool:
    """Whether ``scheduler`` is stepped per epoch (mmengine's default True also for torch schedulers)."""
    return bool(getattr(scheduler, "by_epoch", True))


def _torch_class(name: str) -> type | None:
    cls = getattr(torch.optim.lr_scheduler, name, None)
    if isinstance(cls, type) and issubclass(
        cls, torch.optim.lr_scheduler.LRScheduler | torch.optim.lr_scheduler.ReduceLROnPlateau
    ):
        return cls
    return None


def _build_one(cfg: Mapping[str, Any], optimizer: Any, defaults: dict[str, Any]) -> Any:
    if "type" not in cfg:
        raise ValueError(
            f"a param_scheduler dict needs 'type' (e.g. dict(type='LinearLR', ...)), got {dict(cfg)}"
        )
    args = copy.deepcopy(dict(cfg))
    name = args.pop("type")
    by_epoch = args.get("by_epoch", True)
    convert = args.pop("convert_to_iter_based", False)
    cls = SCHEDULERS.get(name) if isinstance(name, str) else name
    if cls is None and isinstance(name, str) and (tcls := _torch_class(name)) is not None:
        for bad in ("begin", "end", "convert_to_iter_based"):
            if bad in cfg:
                raise ValueError(
                    f"{bad!r} is not supported for torch's {name}; use an mmengine-style scheduler "
                    f"({', '.join(sorted(SCHEDULERS))}) for begin/end windows"
                )
        args.pop("by_epoch", None)
        sched = tcls(_inner_optimizer(optimizer), **args)
        sched.by_epoch = by_epoch
        return sched
    if not (isinstance(cls, type) and issubclass(cls, ParamScheduler)):
        raise ValueError(
            f"unknown param_scheduler type {name!r}; known: {', '.join(sorted(SCHEDULERS))} "
            "and every torch.optim.lr_scheduler class"
        )
    end_key = "max_epochs" if by_epoch else "max_iters"
    if "end" not in args:
        if defaults.get(end_key) is None:
            raise ValueError(
                f"{name} has no 'end' and dispatch_kwargs has no {end_key!r} to default it to "
                f"(by_epoch={by_epoch}); set one of them"
            )
        args["end"] = defaults[end_key]
    if convert:
        return cls.build_iter_from_epoch(optimizer, epoch_length=defaults.get("epoch_length"), **args)
    return cls(optimizer, **args)


def _inner_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """torch schedulers need the ``torch.optim.Optimizer`` itself (an optim wrapper's ``.optimizer``)."""
    inner = optimizer
    while isinstance(inner, OptimWrapper):
        inner = inner.optimizer
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(f"torch schedulers need a torch.optim.Optimizer, got {type(optimizer).__name__}")
    return inner


def build_param_scheduler(
    cfg: Any,
    optimizer: Any,
    *,
    epoch_length: int | None = None,
    max_epochs: int | None = None,
    max_iters: int | None = None,
) -> list[Any]:
    """Build a list of schedulers from a dict, a list of dicts or built schedulers (kept as they are).

    Args:
        cfg: ``dict(type=..., ...)``, a scheduler object or a sequence of them.
        optimizer: the optimizer or optim wrapper whose param groups are scheduled.
        epoch_length: iterations per epoch, needed by ``convert_to_iter_based=True``.
        max_epochs: default ``end`` of epoch-based schedulers.
        max_iters: default ``end`` of iteration-based schedulers.
    """
    items = list(cfg) if isinstance(cfg, Sequence) and not isinstance(cfg, str) else [cfg]
    defaults = {"epoch_length": epoch_length, "max_epochs": max_epochs, "max_iters": max_iters}
    out = []
    for item in items:
        if isinstance(item, Mapping):
            out.append(_build_one(item, optimizer, defaults))
        elif hasattr(item, "step") and hasattr(item, "state_dict"):
            out.append(item)
        else:
            raise TypeError(f"param_scheduler entries must be dicts or schedulers, got {type(item).__name__}")
    return out
