# SPDX-License-Identifier: Apache-2.0
"""Parameter schedulers with mmengine's semantics, buildable from dicts (see :func:`build_param_scheduler`)."""

from __future__ import annotations

from ._param import (
    INF,
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
from .build import SCHEDULERS, build_param_scheduler, scheduler_by_epoch

ConstantLR = SCHEDULERS["ConstantLR"]
CosineAnnealingLR = SCHEDULERS["CosineAnnealingLR"]
ExponentialLR = SCHEDULERS["ExponentialLR"]
LinearLR = SCHEDULERS["LinearLR"]
MultiStepLR = SCHEDULERS["MultiStepLR"]
StepLR = SCHEDULERS["StepLR"]
PolyLR = SCHEDULERS["PolyLR"]
OneCycleLR = SCHEDULERS["OneCycleLR"]

__all__ = [
    "INF",
    "SCHEDULERS",
    "build_param_scheduler",
    "scheduler_by_epoch",
    "ParamScheduler",
    "ConstantParamScheduler",
    "CosineAnnealingParamScheduler",
    "ExponentialParamScheduler",
    "LinearParamScheduler",
    "MultiStepParamScheduler",
    "OneCycleParamScheduler",
    "PolyParamScheduler",
    "StepParamScheduler",
    "ConstantLR",
    "CosineAnnealingLR",
    "ExponentialLR",
    "LinearLR",
    "MultiStepLR",
    "StepLR",
    "PolyLR",
    "OneCycleLR",
]
