# SPDX-License-Identifier: Apache-2.0
"""The steps of :meth:`Strategy.prepare <stepforge.strategy.Strategy.prepare>`: rank 0's weights on every rank,
the accumulation count that keeps a global batch, the optim wrapper on the Booster, the scaled learning rate and
the accumulation window started."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from stepforge.core import OPTIM_WRAPPERS

from ._env import get_world_size
from .booster import Booster
from .optim_wrappers import ColossalAIOptimWrapper

__all__ = [
    "accumulation_for_global_batch",
    "broadcast_weights",
    "build_optim_wrapper",
    "keep_global_batch",
    "scale_lr",
    "start_accumulation",
]


def broadcast_weights(model: nn.Module) -> None:
    """Copy rank 0's parameters and buffers into ``model`` on every rank (meta tensors skipped: ``boost``
    gives every rank the same values); NCCL moves CUDA tensors only, so CPU tensors travel through the current
    device."""
    if get_world_size() == 1:
        return
    staging = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            if tensor.is_meta:
                continue  # lazy: every rank materialises the same values at boost
            if staging is None or tensor.device == staging:
                dist.broadcast(tensor.data, src=0)
            else:
                staged = tensor.data.to(staging)
                dist.broadcast(staged, src=0)
                tensor.data.copy_(staged)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def accumulation_for_global_batch(global_batch: int, world_size: int, micro_batch: Any) -> int:
    """The ``accumulative_counts`` with ``world_size`` x ``micro_batch`` x counts == ``global_batch``
    (DeepSpeed's rule), else a ``ValueError`` listing the micro-batch sizes and world sizes that would
    work."""
    if not isinstance(micro_batch, int) or isinstance(micro_batch, bool) or micro_batch <= 0:
        raise ValueError(
            f"global_batch_size={global_batch} needs dispatch_kwargs['train_micro_batch_size_per_gpu'] (samples "
            f"per rank per micro-batch; FlexibleRunner passes the train dataloader's batch_size), got {micro_batch!r}"
        )
    per_iteration = world_size * micro_batch
    if global_batch % per_iteration == 0:
        return global_batch // per_iteration
    micro = _divisors(global_batch // world_size) if global_batch % world_size == 0 else []
    worlds = _divisors(global_batch // micro_batch) if global_batch % micro_batch == 0 else []
    raise ValueError(
        f"global_batch_size={global_batch} is not a multiple of world size {world_size} x micro-batch "
        f"{micro_batch} (train_micro_batch_size_per_gpu) = {per_iteration}, so no accumulative_counts keeps it. "
        f"At world size {world_size}, micro-batch sizes {micro} work; with micro-batch {micro_batch}, world sizes "
        f"{worlds}; or set global_batch_size to a multiple of {per_iteration}"
    )


def keep_global_batch(cfg: Any, global_batch: int, world_size: int, micro_batch: Any) -> Any:
    """``cfg`` with the ``accumulative_counts`` that keeps ``global_batch``; a count given must be that
    one."""
    counts = accumulation_for_global_batch(global_batch, world_size, micro_batch)
    given = cfg.accumulative_counts if isinstance(cfg, ColossalAIOptimWrapper) else None
    if isinstance(cfg, Mapping):
        given = cfg.get("accumulative_counts")
        cfg = {**cfg, "accumulative_counts": counts}
    if given is not None and given != counts:
        raise ValueError(
            f"optim_wrapper accumulative_counts={given!r} contradicts global_batch_size={global_batch} = world size "
            f"{world_size} x micro-batch {micro_batch} x {counts}: leave accumulative_counts out (global_batch_size "
            "derives it at every world size) or drop global_batch_size"
        )
    return cfg


def _window(counts: Any) -> int | None:
    # None where it is not a positive int: the wrapper's own check names it
    return counts if isinstance(counts, int) and not isinstance(counts, bool) and counts >= 1 else None


def build_optim_wrapper(
    booster: Booster, model: nn.Module, cfg: Any, compile: Any = False
) -> tuple[nn.Module, Any]:
    """Boost ``model`` with the optimizer of ``cfg`` (a dict or a built ``ColossalAIOptimWrapper``); returns
    the model and the optim wrapper, whose ``accumulative_counts`` reaches ``boost`` as
    ``accumulation_steps``."""
    if isinstance(cfg, ColossalAIOptimWrapper):
        steps = _window(cfg.accumulative_counts)
        model, cfg.optimizer = booster.boost(model, cfg.optimizer, compile=compile, accumulation_steps=steps)[
            :2
        ]
        cfg.booster = booster
        return model, cfg
    if not isinstance(cfg, Mapping):
        raise TypeError(
            "Strategy.prepare: optim_wrapper must be a dict (dict(optimizer=dict(type='AdamW', lr=1e-3), "
            f"accumulative_counts=1)) or a ColossalAIOptimWrapper, got {type(cfg).__name__}"
        )
    cfg = dict(cfg)
    name = cfg.pop("type", "ColossalAIOptimWrapper")
    cls = OPTIM_WRAPPERS.get(name) if isinstance(name, str) else name
    if not (isinstance(cls, type) and issubclass(cls, ColossalAIOptimWrapper)):
        raise ValueError(
            f"Strategy.prepare: optim_wrapper type must be ColossalAIOptimWrapper or a subclass (it drives the "
            f"Booster), got {name!r}"
        )
    for key in ("constructor", "paramwise_cfg"):
        if key in cfg:
            raise ValueError(
                f"Strategy.prepare: optim_wrapper {key!r} is not supported; build the optimizer with param "
                "groups yourself and pass it as optim_wrapper=dict(optimizer=<optimizer>)"
            )
    if "optimizer" not in cfg:
        raise ValueError(
            "Strategy.prepare: optim_wrapper needs 'optimizer' (a dict such as dict(type='AdamW'))"
        )
    optimizer = cfg.pop("optimizer")
    optimizer = dict(optimizer) if isinstance(optimizer, Mapping) else optimizer
    steps = _window(cfg.get("accumulative_counts", 1))
    model, optimizer = booster.boost(model, optimizer, compile=compile, accumulation_steps=steps)[:2]
    return model, cls(optimizer, booster=booster, **cfg)


def scale_lr(
    wrapper: Any,
    auto_scale_lr: Mapping[str, Any],
    world_size: int,
    micro_batch: Any,
    logger: logging.Logger,
) -> None:
    """lr *= ``world_size`` * ``micro_batch`` * accumulative_counts / base_batch_size, in place, unless
    disabled."""
    if not auto_scale_lr or not auto_scale_lr.get("enable", True):
        return
    if not isinstance(micro_batch, int) or micro_batch <= 0:
        raise ValueError(
            "auto_scale_lr needs dispatch_kwargs['train_micro_batch_size_per_gpu'] (samples per rank per "
            f"micro-batch), got {micro_batch!r}"
        )
    base = auto_scale_lr["base_batch_size"]
    ratio = world_size * micro_batch * wrapper.accumulative_counts / base
    for group in wrapper.param_groups:
        group["lr"] = group["lr"] * ratio
    if wrapper.base_param_settings is not None and "lr" in wrapper.base_param_settings:
        wrapper.base_param_settings["lr"] *= ratio
    logger.info(
        f"auto_scale_lr: lr scaled by {ratio:g} = world {world_size} x micro-batch {micro_batch} x "
        f"accumulative_counts {wrapper.accumulative_counts} / base {base}"
    )


def start_accumulation(wrapper: Any, model: nn.Module, max_iters: Any) -> None:
    """Start ``wrapper``'s accumulation window at iteration 0 when it accumulates; ``max_iters`` lets the last
    partial window step too."""
    counts = wrapper.accumulative_counts
    if counts <= 1:
        return
    if not isinstance(max_iters, int) or max_iters <= 0:
        raise ValueError(
            f"accumulative_counts={counts} needs dispatch_kwargs['max_iters'] (the number of training "
            "iterations, so the last partial window steps too); pass prepare(..., "
            "dispatch_kwargs=dict(max_iters=N))"
        )
    wrapper.initialize_count_status(model, 0, max_iters)
