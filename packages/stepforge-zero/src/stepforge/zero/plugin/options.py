# SPDX-License-Identifier: Apache-2.0
"""The checks of :class:`~stepforge.zero.plugin.LowLevelZeroPlugin`'s own arguments (those not in its
:class:`~stepforge.zero.config.LowLevelZeroConfig`, which checks itself; nor the loss scaler's, nor the
precision's) and the reading of its ``optimizers`` arguments."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from stepforge.core import HyperParameterError

__all__ = [
    "fixed_stage",
    "check_extra_dp_size",
    "check_flags",
    "check_number",
    "listed_optimizers",
    "single_optimizer",
]


def check_flags(**flags: Any) -> None:
    """Raise naming the first of ``flags`` that is not a bool."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise HyperParameterError(f"LowLevelZeroPlugin: {name} must be a bool, got {value!r}.")


def fixed_stage(kwargs: dict[str, Any], stage: int) -> None:
    """Drop ``stage`` from ``kwargs`` of ``Zero1Plugin``/``Zero2Plugin``; a different one is an error."""
    given = kwargs.pop("stage", stage)
    if given != stage:
        raise HyperParameterError(
            f"zero{stage} is LowLevelZeroPlugin(stage={stage}); got stage={given!r}. Use the plugin name "
            f"'zero{given}' or 'low_level_zero' with stage={given!r}."
        )


def check_extra_dp_size(value: Any) -> int:
    """``extra_dp_size`` as given when it is an int >= 1 (> 1 needs ``torch.distributed`` initialised)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise HyperParameterError(
            f"LowLevelZeroPlugin: extra_dp_size must be an int >= 1 (1: no extra data-parallel axis), got {value!r}."
        )
    if value > 1 and not (dist.is_available() and dist.is_initialized()):
        raise HyperParameterError(
            f"LowLevelZeroPlugin: extra_dp_size={value} needs torch.distributed initialised first (its 2-D grid "
            "is built over the default group); call init_process_group before building the plugin."
        )
    return value


def check_number(name: str, value: Any, low: float, *, strict: bool) -> None:
    """Raise unless ``value`` is a number above ``low`` (``strict``) or at least ``low``."""
    ok = (
        not isinstance(value, bool)
        and isinstance(value, int | float)
        and (value > low if strict else value >= low)
    )
    if not ok:
        relation = ">" if strict else ">="
        raise HyperParameterError(
            f"LowLevelZeroPlugin: {name} must be a number {relation} {low:g}, got {value!r}."
        )


def listed_optimizers(optimizers: Any) -> list[Any]:
    """``None`` (the one prepared) or one optimizer as a one-item list, an iterable as a list."""
    if optimizers is None or isinstance(optimizers, torch.optim.Optimizer):
        return [optimizers]
    return list(optimizers)


def single_optimizer(items: list[Any]) -> Any:
    """The one optimizer of ``items``; a checkpoint pair holds one optimizer per model."""
    if len(items) != 1:
        raise HyperParameterError(
            f"LowLevelZeroPlugin: checkpoints hold one optimizer per model, got {len(items)}; prepare one optimizer."
        )
    return items[0]
