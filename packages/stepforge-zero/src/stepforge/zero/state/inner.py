# SPDX-License-Identifier: Apache-2.0
"""The inner optimizer, which steps this rank's master pieces and holds their state: a registry config or a
built one, what CPU offload needs from it, and its cache.

With ``cpu_offload=True`` the master shards, their gradients and the optimizer state live on the CPU and the
inner optimizer steps them there. A registry config of the Adam family (``Adam``, ``AdamW``, ``FusedAdam``,
``HybridAdam``) is built as stepforge-fused's ``CPUAdam`` when that is installed (found through
:data:`stepforge.core.OPTIMIZERS`; same math, SIMD kernel); any other config or built optimizer is used as
given and must be able to step CPU tensors -- if its first step fails there, the error says so.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from stepforge.core import OPTIMIZERS, CachingOptimizer, HyperParameterError, build_optimizer

from .partition import ShardLayout

__all__ = [
    "resolve_optimizer",
    "CPU_ADAM_FAMILY",
    "copy_hyperparameters",
    "cpu_step_error",
    "invalidate_cache",
    "step_inner",
]

#: registry names that CPU offload turns into ``CPUAdam`` (value: its ``adamw_mode``)
CPU_ADAM_FAMILY = {"adam": False, "adamw": True, "fusedadam": None, "hybridadam": None}

_ADAM_KEYS = ("lr", "betas", "eps", "weight_decay", "bias_correction", "adamw_mode")


def _cpu_adam_config(cfg: Mapping[str, Any]) -> dict[str, Any] | None:
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
    """The inner optimizer, built from a registry config when needed.

    Raises:
        HyperParameterError: ``params`` given with a built optimizer, missing with a config, a built optimizer
            that already has state, or an optimizer that is neither.
    """
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
            cfg = _cpu_adam_config(cfg) or cfg
        return build_optimizer(cfg, params)
    raise HyperParameterError(
        "LowLevelZeroOptimizer: optimizer must be a torch.optim.Optimizer or a config dict such as "
        f"dict(type='AdamW', lr=1e-3), got {type(optimizer).__name__}."
    )


def cpu_step_error(inner: torch.optim.Optimizer, exc: BaseException) -> RuntimeError:
    """The error for an inner optimizer that cannot step the CPU-offloaded shards."""
    hint = (
        "install stepforge-fused and use CPUAdam (dict(type='CPUAdam', ...))"
        if "CPUAdam" not in OPTIMIZERS
        else "use dict(type='CPUAdam', ...) or a torch.optim optimizer without fused/capturable CUDA options"
    )
    return RuntimeError(
        f"LowLevelZeroOptimizer(cpu_offload=True): the inner optimizer {type(inner).__name__} cannot step the "
        f"CPU-resident master shards ({type(exc).__name__}: {exc}); {hint}, or set cpu_offload=False."
    )


def invalidate_cache(inner: torch.optim.Optimizer) -> None:
    """Drop ``inner``'s cached tensor lists (after its params or state were swapped); no-op for others."""
    if isinstance(inner, CachingOptimizer):
        inner.invalidate_cache()


def copy_hyperparameters(source: list[dict[str, Any]], target: list[dict[str, Any]]) -> None:
    """Every key but ``"params"`` of each ``source`` group into the matching ``target`` group.

    Edits between steps (schedulers, users) live in the wrapper's groups and go to the inner optimizer before
    its step; what the inner optimizer keeps in its groups (a per-group step count) comes back after it.
    """
    for theirs, ours in zip(source, target, strict=True):
        for key, value in theirs.items():
            if key != "params":
                ours[key] = value


def step_inner(
    inner: torch.optim.Optimizer,
    layout: ShardLayout,
    param_groups: list[dict[str, Any]],
    *,
    explain_cpu_failure: bool,
) -> None:
    """One step of ``inner`` over this rank's master pieces: the wrapper's ``param_groups`` hyper-parameters go in,
    each slot's reduced gradient piece is the master's ``.grad`` for the step only, and what the inner optimizer
    keeps in its groups comes back.

    Raises:
        RuntimeError: with ``explain_cpu_failure`` (CPU offload, first step), an inner optimizer that cannot step
            the CPU pieces: :func:`cpu_step_error`'s message.
    """
    copy_hyperparameters(param_groups, inner.param_groups)
    for slot in layout.slots:
        if slot.valid:
            slot.master.grad = slot.grad
    try:
        inner.step()
    except (RuntimeError, TypeError, NotImplementedError) as exc:
        if explain_cpu_failure:
            raise cpu_step_error(inner, exc) from exc
        raise
    finally:
        for slot in layout.slots:
            slot.master.grad = None
    copy_hyperparameters(inner.param_groups, param_groups)
