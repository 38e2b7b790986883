# SPDX-License-Identifier: Apache-2.0
"""``LowLevelZeroOptimizer``'s settings: one frozen :class:`LowLevelZeroConfig`, checked once where it is built
(``LowLevelZeroOptimizer(...)`` or ``LowLevelZeroPlugin(...)``, which hands it to every optimizer it builds) and
passed through unchanged; what depends on the process group is derived when the optimizer is built.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch

from stepforge.core import OPTIMIZERS, HyperParameterError, build_optimizer
from stepforge.core.precision import LOSS_SCALER_DEFAULTS, LossScalerArgs

from .comm.algorithm import COLOSSAL_OPTIMIZER_BUCKET_SIZE, check_comm_algorithm
from .comm.grid import grid_group

__all__ = [
    "LowLevelZeroConfig",
    "disagree",
    "resolve_group",
    "resolve_optimizer",
    "cpu_adam_config",
]

_FLAGS = (
    "fp8_communication",
    "overlap_communication",
    "overlap_allgather",
    "cpu_offload",
    "master_weights",
    "verbose",
)


@dataclass(frozen=True)
class LowLevelZeroConfig:
    """Every setting of a ``LowLevelZeroOptimizer`` that does not depend on its process group, each checked once
    when the object is made (the error names the field and ``owner``, the door's name). The fields are the
    optimizer's keywords (see its docstring), except ``reduce_bucket_size=None``: the group's default (4 Mi on gloo,
    else ``default_bucket_size``: ColossalAI's 1 Mi for the optimizer, 12 Mi for the plugin), and ``scaler``: the
    dynamic loss scaler's arguments (checked by ``validate_loss_scaler_args`` at the door)."""

    stage: int = 1
    reduce_bucket_size: int | None = None
    default_bucket_size: int = COLOSSAL_OPTIMIZER_BUCKET_SIZE
    communication_dtype: torch.dtype | None = None
    fp8_communication: bool = False
    comm_algorithm: str = "auto"
    param_gather: str | None = None
    overlap_communication: bool = False
    overlap_allgather: bool = False
    cpu_offload: bool = False
    master_weights: bool = True
    forced_dtype: torch.dtype | None = None
    max_norm: float = 0.0
    norm_type: float = 2.0
    dtype_for_loss_scaling: str | None = None
    scaler: LossScalerArgs = field(default_factory=lambda: LossScalerArgs(**LOSS_SCALER_DEFAULTS))
    verbose: bool = False
    backward_context: Callable[[], AbstractContextManager[Any]] | None = None
    owner: str = field(default="LowLevelZeroOptimizer", compare=False, repr=False)

    def __post_init__(self) -> None:
        def bad(message: str) -> HyperParameterError:
            return HyperParameterError(f"{self.owner}: {message}")

        if self.stage not in (1, 2) or isinstance(self.stage, bool):
            raise bad(f"stage must be 1 or 2, got {self.stage!r}.")
        size = self.reduce_bucket_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise bad(f"reduce_bucket_size must be an int >= 1, got {size!r}.")
        for name in _FLAGS:
            if not isinstance(getattr(self, name), bool):
                raise bad(f"{name} must be a bool, got {getattr(self, name)!r}.")
        for name in ("communication_dtype", "forced_dtype"):
            dtype = getattr(self, name)
            if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                raise bad(
                    f"{name} must be None or a floating torch.dtype (torch.float32, torch.bfloat16, ...), got "
                    f"{dtype!r}."
                )
        check_comm_algorithm(self.comm_algorithm)
        if self.param_gather not in (None, "all_gather", "broadcast"):
            raise bad(
                f"param_gather must be None (automatic), 'all_gather' or 'broadcast', got {self.param_gather!r}."
            )
        norm = self.max_norm
        if not isinstance(norm, int | float) or isinstance(norm, bool) or not norm >= 0:
            raise bad(f"max_norm must be a number >= 0 (0 disables clipping), got {norm!r}.")
        norm_type = self.norm_type
        if isinstance(norm_type, bool) or not isinstance(norm_type, int | float) or not norm_type > 0:
            raise bad(f"norm_type must be > 0 or inf, got {norm_type!r}.")
        if self.dtype_for_loss_scaling not in (None, "fp16"):
            raise bad(
                "dtype_for_loss_scaling must be None (automatic: on for fp16 params) or 'fp16', got "
                f"{self.dtype_for_loss_scaling!r}."
            )
        if self.backward_context is not None and not callable(self.backward_context):
            raise bad(
                f"backward_context must be a callable returning a context manager, got {self.backward_context!r}."
            )
        object.__setattr__(self, "max_norm", float(norm))
        object.__setattr__(self, "norm_type", math.inf if math.isinf(norm_type) else float(norm_type))


def disagree(ours: str, ours_value: Any, theirs: str, theirs_value: Any) -> HyperParameterError:
    """The error for a setting given under stepforge's and ColossalAI's name with different values."""
    return HyperParameterError(
        f"LowLevelZeroOptimizer: {ours}={ours_value!r} and ColossalAI's {theirs}={theirs_value!r} disagree; "
        f"pass one of them ({theirs} is the ColossalAI name of {ours})."
    )


def resolve_group(
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
        raise disagree("process_group", process_group, "dp_process_group", dp_process_group)
    group = process_group if process_group is not None else dp_process_group
    if pg_to_param_list is not None:
        if group is not None:
            raise HyperParameterError(
                "LowLevelZeroOptimizer: dp_process_group and pg_to_param_list should not be provided at the same "
                "time (as in ColossalAI); pass one."
            )
        if not isinstance(pg_to_param_list, Mapping) or len(pg_to_param_list) != 1:
            count = len(pg_to_param_list) if isinstance(pg_to_param_list, Mapping) else "no"
            raise HyperParameterError(
                f"LowLevelZeroOptimizer: pg_to_param_list must map one process group to the optimizer's "
                f"parameters, got {count} groups; parameters sharded over different groups (MoE experts) are not "
                "supported: build one LowLevelZeroOptimizer per group, or pass dp_process_group."
            )
        ((group, params),) = pg_to_param_list.items()
        if {id(p) for p in params} != {id(p) for g in inner.param_groups for p in g["params"]}:
            raise HyperParameterError(
                "LowLevelZeroOptimizer: pg_to_param_list's parameters must be exactly the optimizer's parameters."
            )
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


#: registry names that CPU offload turns into ``CPUAdam`` (value: its ``adamw_mode``)
CPU_ADAM_FAMILY = {"adam": False, "adamw": True, "fusedadam": None, "hybridadam": None}

_ADAM_KEYS = ("lr", "betas", "eps", "weight_decay", "bias_correction", "adamw_mode")


def cpu_adam_config(cfg: Mapping[str, Any]) -> dict[str, Any] | None:
    """``cfg`` as stepforge-fused's ``CPUAdam`` (same math, SIMD kernel) when it is an Adam-family config that
    ``CPUAdam`` can run and ``CPUAdam`` is registered; else ``None`` (the user's optimizer is kept, and must be
    able to step the CPU pieces)."""
    kind = cfg.get("type")
    if not isinstance(kind, str) or "CPUAdam" not in OPTIMIZERS:
        return None
    key = kind.lower().replace("-", "").replace("_", "")
    if key not in CPU_ADAM_FAMILY:
        return None
    extra = {k: v for k, v in cfg.items() if k != "type" and k not in _ADAM_KEYS}
    torch_only = {"amsgrad", "maximize", "foreach", "fused", "capturable", "differentiable"}
    if any(k in torch_only and v not in (False, None) for k, v in extra.items()):
        return None  # a torch option CPUAdam does not have: keep the user's optimizer
    out = {k: cfg[k] for k in _ADAM_KEYS if k in cfg}
    mode = CPU_ADAM_FAMILY[key]
    if mode is not None:
        out["adamw_mode"] = mode
    out["type"] = "CPUAdam"
    return out


def resolve_optimizer(
    optimizer: torch.optim.Optimizer | Mapping[str, Any],
    params: Any,
    *,
    cpu_offload: bool,
) -> torch.optim.Optimizer:
    """The inner optimizer, built from a registry config (with ``params``) when needed; a built one must not
    have state yet."""
    if isinstance(optimizer, torch.optim.Optimizer):
        if params is not None:
            raise HyperParameterError(
                "LowLevelZeroOptimizer: params is only for a config dict; a built optimizer already holds its "
                "parameters (drop params=)."
            )
        if optimizer.state:
            raise HyperParameterError(
                "LowLevelZeroOptimizer: the inner optimizer already has state; wrap it before its first step and "
                "restore checkpoints through LowLevelZeroOptimizer.load_state_dict."
            )
        return optimizer
    if isinstance(optimizer, Mapping):
        if params is None:
            raise HyperParameterError(
                "LowLevelZeroOptimizer: a config dict needs params= (the model or its param groups), e.g. "
                "LowLevelZeroOptimizer(dict(type='AdamW', lr=1e-3), params=model.parameters())."
            )
        cfg = dict(optimizer)
        if cpu_offload:
            cfg = cpu_adam_config(cfg) or cfg
        return build_optimizer(cfg, params)
    raise HyperParameterError(
        "LowLevelZeroOptimizer: optimizer must be a torch.optim.Optimizer or a config dict such as "
        f"dict(type='AdamW', lr=1e-3), got {type(optimizer).__name__}."
    )
