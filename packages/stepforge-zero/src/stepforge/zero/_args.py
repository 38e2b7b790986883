# SPDX-License-Identifier: Apache-2.0
"""The argument checks of ``LowLevelZeroOptimizer`` and the data-parallel group facts it starts from."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from stepforge.core import HyperParameterError

__all__ = ["check_args", "group_facts", "resolve_param_gather"]


def check_args(
    stage: Any, reduce_bucket_size: Any, max_norm: Any, dtype_for_loss_scaling: Any, param_gather: Any
) -> None:
    """Validate ``LowLevelZeroOptimizer``'s own arguments (the scaler validates its own)."""
    if stage not in (1, 2) or isinstance(stage, bool):
        raise HyperParameterError(f"LowLevelZeroOptimizer: stage must be 1 or 2, got {stage!r}.")
    if (
        isinstance(reduce_bucket_size, bool)
        or not isinstance(reduce_bucket_size, int)
        or reduce_bucket_size < 1
    ):
        raise HyperParameterError(
            f"LowLevelZeroOptimizer: reduce_bucket_size must be an int >= 1, got {reduce_bucket_size!r}."
        )
    if not isinstance(max_norm, int | float) or isinstance(max_norm, bool) or not max_norm >= 0:
        raise HyperParameterError(
            f"LowLevelZeroOptimizer: max_norm must be a number >= 0 (0 disables clipping), got {max_norm!r}."
        )
    if dtype_for_loss_scaling not in (None, "fp16"):
        raise HyperParameterError(
            "LowLevelZeroOptimizer: dtype_for_loss_scaling must be None (automatic: on for fp16 params) or "
            f"'fp16', got {dtype_for_loss_scaling!r}."
        )
    if param_gather not in (None, "all_gather", "broadcast"):
        raise HyperParameterError(
            "LowLevelZeroOptimizer: param_gather must be None (automatic), 'all_gather' or 'broadcast', got "
            f"{param_gather!r}."
        )


def group_facts(process_group: Any) -> tuple[int, int]:
    """``(world_size, rank)`` of the data-parallel group; ``(1, 0)`` without ``torch.distributed``."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(process_group), dist.get_rank(process_group)
    if process_group is not None:
        raise HyperParameterError(
            "LowLevelZeroOptimizer: process_group was given but torch.distributed is not initialised; call "
            "torch.distributed.init_process_group first."
        )
    return 1, 0


def resolve_param_gather(param_gather: str | None, world_size: int, process_group: Any) -> str:
    """``param_gather`` as given, or for ``None``: ``"broadcast"`` on gloo (several times faster than gloo's
    all-gather on the CPU), ``"all_gather"`` elsewhere."""
    if param_gather is not None:
        return param_gather
    gloo = world_size > 1 and dist.get_backend(process_group) == "gloo"
    return "broadcast" if gloo else "all_gather"
