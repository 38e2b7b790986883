# SPDX-License-Identifier: Apache-2.0
"""What :class:`~stepforge.zero.plugin.LowLevelZeroPlugin` passes to every optimizer it builds
(:class:`OptimizerOptions`, ColossalAI's ``zero_optim_kwargs`` as a frozen dataclass), the plugin's argument
checks that are not the loss scaler's (``stepforge.core.precision.validate_loss_scaler_args``) nor the
precision's, and the reading of its ``optimizers`` arguments."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from stepforge.core import HyperParameterError
from stepforge.core.precision import LossScalerArgs

from ..comm.algorithm import default_bucket_size

__all__ = [
    "OptimizerOptions",
    "fixed_stage",
    "check_extra_dp_size",
    "check_flags",
    "check_number",
    "listed_optimizers",
    "single_optimizer",
]


@dataclass(frozen=True)
class OptimizerOptions:
    """The plugin's settings of each ``LowLevelZeroOptimizer`` it builds (checked by the plugin).

    Attributes:
        stage: 1 or 2.
        reduce_bucket_size_in_m: bucket size in millions of elements (``None``: the backend's default).
        communication_dtype, overlap_communication, overlap_allgather, cpu_offload, master_weights, max_norm,
            norm_type, verbose, fp8_communication: passed to the optimizer as they are.
        scaler: the dynamic loss scaler's arguments.
    """

    stage: int
    reduce_bucket_size_in_m: float | None
    communication_dtype: torch.dtype | None
    overlap_communication: bool
    overlap_allgather: bool
    cpu_offload: bool
    master_weights: bool
    max_norm: float
    norm_type: float
    verbose: bool
    fp8_communication: bool
    scaler: LossScalerArgs

    def optimizer_kwargs(self, dp_process_group: Any, extra_dp_group: Any) -> dict[str, Any]:
        """The keywords of ``LowLevelZeroOptimizer`` for an optimizer sharded over ``dp_process_group`` (and
        the 2-D grid with ``extra_dp_group``); the bucket size resolved for that group."""
        bucket = (
            default_bucket_size(dp_process_group)
            if self.reduce_bucket_size_in_m is None
            else int(self.reduce_bucket_size_in_m * 1024**2)
        )
        return dict(
            stage=self.stage,
            reduce_bucket_size=bucket,
            communication_dtype=self.communication_dtype,
            overlap_communication=self.overlap_communication,
            overlap_allgather=self.overlap_allgather,
            cpu_offload=self.cpu_offload,
            master_weights=self.master_weights,
            max_norm=self.max_norm,
            norm_type=self.norm_type,
            verbose=self.verbose,
            fp8_communication=self.fp8_communication,
            dp_process_group=dp_process_group,
            extra_dp_group=extra_dp_group,
            **self.scaler,
        )


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
