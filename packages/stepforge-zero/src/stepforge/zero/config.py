# SPDX-License-Identifier: Apache-2.0
"""``LowLevelZeroOptimizer``'s settings: small frozen dataclasses, one per concern, resolved once from the flat
keywords of its public signature (ColossalAI's names reconciled with stepforge's).

- :class:`ShardingConfig`: the stage, the data-parallel group and where the masters live;
- :class:`CommConfig`: how gradients are reduced and the updated pieces gathered;
- :class:`StepConfig`: what a step does before the inner optimizer (clipping, fp16 loss scaling);
- :class:`LowLevelZeroConfig`: the three together, with the logging and backward context.

:func:`resolve_config` checks every value where it enters and names the argument in its error.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from stepforge.core import HyperParameterError
from stepforge.core.precision import LossScalerArgs

from .comm.algorithm import COLOSSAL_OPTIMIZER_BUCKET_SIZE, default_bucket_size, resolve_comm_algorithm
from .comm.grid import grid_group
from .comm.wire import WireFormat
from .grads.norm import check_clip_args

__all__ = [
    "ShardingConfig",
    "CommConfig",
    "StepConfig",
    "LowLevelZeroConfig",
    "resolve_config",
    "group_facts",
    "resolve_param_gather",
    "param_gather_for",
    "force_dtype",
]


@dataclass(frozen=True)
class ShardingConfig:
    """Who holds what.

    Attributes:
        stage: 1 (optimizer state sharded) or 2 (gradients too).
        process_group: the data-parallel group (``None``: the default group, or none at one process).
        world_size, rank: that group's size and this process's rank in it.
        cpu_offload: masters, gradient pieces and optimizer state on the CPU.
        master_weights: fp32 masters for fp16/bf16 working parameters.
        forced_dtype: the dtype every working parameter is converted to first (``None``: kept).
    """

    stage: int
    process_group: Any
    world_size: int
    rank: int
    cpu_offload: bool
    master_weights: bool
    forced_dtype: torch.dtype | None


@dataclass(frozen=True)
class CommConfig:
    """How gradients and updated pieces travel.

    Attributes:
        reduce_bucket_size: padded elements per gradient bucket.
        wire: the dtype on the wire (``communication_dtype``, fp8).
        algorithm: the bucket reduction, resolved (``"reduce_scatter"``, ``"all_reduce"``, ``"all_to_all"``).
        param_gather: the post-step gather, resolved (``"broadcast"`` or ``"all_gather"``).
        overlap_communication: reductions launched asynchronously during backward.
        overlap_allgather: the gather overlapped with the next forward.
    """

    reduce_bucket_size: int
    wire: WireFormat
    algorithm: str
    param_gather: str
    overlap_communication: bool
    overlap_allgather: bool


@dataclass(frozen=True)
class StepConfig:
    """What a step does to the gradients before the inner optimizer steps.

    Attributes:
        max_norm: global-norm clipping (0: off); norm_type: its norm.
        dtype_for_loss_scaling: ``"fp16"`` forces loss scaling; ``None``: on when a working parameter is fp16.
        scaler: the validated arguments of the dynamic loss scaler.
    """

    max_norm: float
    norm_type: float
    dtype_for_loss_scaling: str | None
    scaler: LossScalerArgs


@dataclass(frozen=True)
class LowLevelZeroConfig:
    """Every setting of one ``LowLevelZeroOptimizer``."""

    sharding: ShardingConfig
    comm: CommConfig
    step: StepConfig
    verbose: bool
    backward_context: Callable[[], AbstractContextManager[Any]] | None


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


def _check_own_args(
    stage: Any, reduce_bucket_size: Any, max_norm: Any, dtype_for_loss_scaling: Any, param_gather: Any
) -> None:
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


def _same_or_error(ours: str, ours_value: Any, theirs: str, theirs_value: Any) -> None:
    raise HyperParameterError(
        f"LowLevelZeroOptimizer: {ours}={ours_value!r} and ColossalAI's {theirs}={theirs_value!r} disagree; "
        f"pass one of them ({theirs} is the ColossalAI name of {ours})."
    )


def _stage(stage: Any, partition_grad: Any) -> Any:
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


def _process_group(
    inner: torch.optim.Optimizer,
    process_group: Any,
    dp_process_group: Any,
    extra_dp_group: Any,
    pg_to_param_list: Any,
    fp8_communication: Any,
) -> Any:
    """The group to shard over: stepforge's ``process_group``, ColossalAI's ``dp_process_group`` or
    ``pg_to_param_list``, and with ``extra_dp_group`` the group of the 2-D grid (collective over the default
    group)."""
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
    return group


def resolve_config(
    inner: torch.optim.Optimizer,
    *,
    scaler: LossScalerArgs,
    stage: Any,
    partition_grad: Any,
    max_norm: Any,
    clip_grad_norm: Any,
    norm_type: Any,
    dtype_for_loss_scaling: Any,
    process_group: Any,
    dp_process_group: Any,
    extra_dp_group: Any,
    pg_to_param_list: Any,
    reduce_bucket_size: Any,
    communication_dtype: Any,
    fp8_communication: Any,
    comm_algorithm: Any,
    param_gather: Any,
    overlap_communication: Any,
    overlap_allgather: Any,
    cpu_offload: Any,
    master_weights: Any,
    forced_dtype: Any,
    verbose: Any,
    backward_context: Any,
) -> LowLevelZeroConfig:
    """Check ``LowLevelZeroOptimizer``'s arguments (``scaler`` already validated) and reconcile ColossalAI's
    names (``partition_grad``, ``clip_grad_norm``, ``dp_process_group``, ``extra_dp_group``,
    ``pg_to_param_list``) with stepforge's (``stage``, ``max_norm``, ``process_group``). Collective over the
    default group when ``extra_dp_group`` is given. Changes nothing (``forced_dtype`` is applied by
    :func:`force_dtype`).

    Raises:
        HyperParameterError: a bad value, or two names of one setting that disagree.
    """
    resolved_stage = _stage(stage, partition_grad)
    norm = _max_norm(max_norm, clip_grad_norm)
    group = _process_group(
        inner, process_group, dp_process_group, extra_dp_group, pg_to_param_list, fp8_communication
    )
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
    if reduce_bucket_size is None:
        reduce_bucket_size = default_bucket_size(group, elsewhere=COLOSSAL_OPTIMIZER_BUCKET_SIZE)
    _check_own_args(resolved_stage, reduce_bucket_size, norm, dtype_for_loss_scaling, param_gather)
    norm_type = check_clip_args(1.0, norm_type)
    world_size, rank = group_facts(group)
    sharding = ShardingConfig(
        stage=resolved_stage,
        process_group=group,
        world_size=world_size,
        rank=rank,
        cpu_offload=bool(cpu_offload),
        master_weights=bool(master_weights),
        forced_dtype=forced_dtype,
    )
    comm = CommConfig(
        reduce_bucket_size=reduce_bucket_size,
        wire=WireFormat(communication_dtype, fp8_communication),
        algorithm=resolve_comm_algorithm(
            comm_algorithm, stage=resolved_stage, world_size=world_size, process_group=group
        ),
        param_gather=resolve_param_gather(param_gather, world_size, group),
        overlap_communication=bool(overlap_communication),
        overlap_allgather=bool(overlap_allgather),
    )
    step = StepConfig(float(norm), norm_type, dtype_for_loss_scaling, scaler)
    return LowLevelZeroConfig(sharding, comm, step, bool(verbose), backward_context)


def force_dtype(inner: torch.optim.Optimizer, dtype: torch.dtype | None) -> None:
    """ColossalAI's ``forced_dtype``: convert every working parameter in place (``param.data``), so the model
    and the optimizer keep the same parameter objects."""
    if dtype is None:
        return
    for group in inner.param_groups:
        for param in group["params"]:
            param.data = param.data.to(dtype)
