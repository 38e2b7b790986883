# SPDX-License-Identifier: Apache-2.0
"""The argument checks of ``LowLevelZeroOptimizer`` (ColossalAI's names reconciled with stepforge's) and the
data-parallel group facts it starts from."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from stepforge.core import HyperParameterError

from ._hybrid import grid_group
from ._wire import WireFormat

__all__ = [
    "check_args",
    "group_facts",
    "resolve_param_gather",
    "param_gather_for",
    "ZeroArgs",
    "resolve_args",
    "force_dtype",
]


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
    return param_gather_for(dist.get_backend(process_group) if world_size > 1 else None)


def param_gather_for(backend: str | None) -> str:
    """The automatic ``param_gather`` on ``backend`` (``None``: one rank): ``"broadcast"`` on gloo, else
    ``"all_gather"`` (the rule without a live group, for memory plans)."""
    return "broadcast" if backend == "gloo" else "all_gather"


@dataclass(frozen=True)
class ZeroArgs:
    """``LowLevelZeroOptimizer``'s arguments once ColossalAI's names and stepforge's are reconciled."""

    stage: int
    max_norm: float
    process_group: Any
    wire: WireFormat
    forced_dtype: torch.dtype | None


def _same_or_error(ours: str, ours_value: Any, theirs: str, theirs_value: Any) -> None:
    raise HyperParameterError(
        f"LowLevelZeroOptimizer: {ours}={ours_value!r} and ColossalAI's {theirs}={theirs_value!r} disagree; "
        f"pass one of them ({theirs} is the ColossalAI name of {ours})."
    )


def _stage(stage: Any, partition_grad: Any) -> int:
    if not isinstance(partition_grad, bool):
        raise HyperParameterError(
            f"LowLevelZeroOptimizer: partition_grad must be a bool (True: ZeRO-2), got {partition_grad!r}."
        )
    if stage is None:
        return 2 if partition_grad else 1
    if partition_grad and stage != 2:
        _same_or_error("stage", stage, "partition_grad", partition_grad)
    return int(stage) if stage in (1, 2) and not isinstance(stage, bool) else stage


def _max_norm(max_norm: Any, clip_grad_norm: Any) -> Any:
    if max_norm is None:
        return clip_grad_norm
    if clip_grad_norm not in (0, 0.0) and clip_grad_norm != max_norm:
        _same_or_error("max_norm", max_norm, "clip_grad_norm", clip_grad_norm)
    return max_norm


def _group_of(pg_to_param_list: Any, inner: torch.optim.Optimizer) -> Any:
    """The one data-parallel group (or ``(extra, dp)`` pair) of ColossalAI's ``pg_to_param_list``."""
    if not isinstance(pg_to_param_list, Mapping) or len(pg_to_param_list) != 1:
        count = len(pg_to_param_list) if isinstance(pg_to_param_list, Mapping) else "no"
        raise HyperParameterError(
            f"LowLevelZeroOptimizer: pg_to_param_list must map one process group to the optimizer's parameters, "
            f"got {count} groups; parameters sharded over different groups (MoE experts) are not supported: "
            "build one LowLevelZeroOptimizer per group, or pass dp_process_group."
        )
    ((group, params),) = pg_to_param_list.items()
    ours = {id(p) for g in inner.param_groups for p in g["params"]}
    if {id(p) for p in params} != ours:
        raise HyperParameterError(
            "LowLevelZeroOptimizer: pg_to_param_list's parameters must be exactly the optimizer's parameters."
        )
    return group


def resolve_args(
    inner: torch.optim.Optimizer,
    *,
    stage: Any,
    partition_grad: Any,
    max_norm: Any,
    clip_grad_norm: Any,
    process_group: Any,
    dp_process_group: Any,
    extra_dp_group: Any,
    pg_to_param_list: Any,
    communication_dtype: Any,
    fp8_communication: Any,
    forced_dtype: Any,
    backward_context: Any,
) -> ZeroArgs:
    """Reconcile ColossalAI's names (``partition_grad``, ``clip_grad_norm``, ``dp_process_group``,
    ``extra_dp_group``, ``pg_to_param_list``) with stepforge's (``stage``, ``max_norm``, ``process_group``) and
    check the wire and dtype arguments. Collective over the default group when ``extra_dp_group`` is given.

    Raises:
        HyperParameterError: a bad value, or two names of one setting that disagree.
    """
    resolved_stage = _stage(stage, partition_grad)
    norm = _max_norm(max_norm, clip_grad_norm)
    if process_group is not None and dp_process_group is not None and process_group is not dp_process_group:
        _same_or_error("process_group", process_group, "dp_process_group", dp_process_group)
    group = process_group if process_group is not None else dp_process_group
    if pg_to_param_list is not None:
        if group is not None:
            raise HyperParameterError(
                "LowLevelZeroOptimizer: dp_process_group and pg_to_param_list should not be provided at the same "
                "time (as in ColossalAI); pass one."
            )
        group = _group_of(pg_to_param_list, inner)
        if isinstance(group, tuple):
            if len(group) == 1:
                group = group[0]
            elif len(group) == 2:
                extra_dp_group, group = group
            else:
                raise HyperParameterError(
                    f"LowLevelZeroOptimizer: a pg_to_param_list key is a group or an (extra, dp) pair, got "
                    f"{len(group)} groups."
                )
    if not isinstance(fp8_communication, bool):
        raise HyperParameterError(
            f"LowLevelZeroOptimizer: fp8_communication must be a bool, got {fp8_communication!r}."
        )
    if extra_dp_group is not None:
        if group is None:
            raise HyperParameterError(
                "LowLevelZeroOptimizer: dp_process_group should be provided when extra_dp_group is provided (the "
                "inner data-parallel group of the 2-D grid)."
            )
        if fp8_communication and pg_to_param_list is None:
            raise HyperParameterError(
                "LowLevelZeroOptimizer: fp8_communication is not supported with extra_dp_group (as in ColossalAI); "
                "set fp8_communication=False."
            )
        group = grid_group(extra_dp_group, group)
    for name, dtype in (("communication_dtype", communication_dtype), ("forced_dtype", forced_dtype)):
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise HyperParameterError(
                f"LowLevelZeroOptimizer: {name} must be None or a floating torch.dtype (torch.float32, "
                f"torch.bfloat16, ...), got {dtype!r}."
            )
    if backward_context is not None and not callable(backward_context):
        raise HyperParameterError(
            "LowLevelZeroOptimizer: backward_context must be a callable returning a context manager, got "
            f"{backward_context!r}."
        )
    return ZeroArgs(
        stage=resolved_stage,
        max_norm=norm,
        process_group=group,
        wire=WireFormat(communication_dtype, fp8_communication),
        forced_dtype=forced_dtype,
    )


def force_dtype(inner: torch.optim.Optimizer, dtype: torch.dtype | None) -> None:
    """ColossalAI's ``forced_dtype``: convert every working parameter in place (``param.data``), so the model
    and the optimizer keep the same parameter objects."""
    if dtype is None:
        return
    for group in inner.param_groups:
        for param in group["params"]:
            param.data = param.data.to(dtype)
