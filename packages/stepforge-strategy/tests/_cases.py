# SPDX-License-Identifier: Apache-2.0
"""Shared by the strategy tests: a small model, deterministic data, the reference run, the Booster run."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from stepforge.strategy import Booster, ColossalAIOptimWrapper
from stepforge.testing.models import BlockNet as Net
from stepforge.testing.models import block_net

D_IN = 6
MICRO = 4  # rows per micro-batch per rank


def make_model(seed: int = 0) -> Net:
    """Two blocks in a ModuleList (sharded one by one by FSDP2) and a head."""
    return block_net(seed, d_in=D_IN, width=16)


def window(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of optimizer step ``step`` (``rows`` rows), the same in every process."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(rows, D_IN, generator=g)
    y = torch.sin(x.sum(dim=1, keepdim=True)) + 0.1 * torch.randn(rows, 1, generator=g)
    return x, y


def micro_batch(step: int, micro: int, rank: int, world: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s micro-batch ``micro`` of step ``step`` (rows ``(rank*k + micro)*MICRO`` on)."""
    x, y = window(step, world * k * MICRO)
    start = (rank * k + micro) * MICRO
    return x[start : start + MICRO], y[start : start + MICRO]


def make_optimizer(params: Any, name: str = "AdamW") -> torch.optim.Optimizer:
    if name == "AdamW":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
    if name == "SGD":
        return torch.optim.SGD(params, lr=5e-2, momentum=0.9)
    raise ValueError(name)


def reference_run(steps: int, rows: int, first_step: int = 0, model: Net | None = None,
                  optimizer: Any = None) -> tuple[Net, list[float]]:  # fmt: skip
    """Plain torch, one process, fp32: each step on the whole window (mean loss)."""
    model = model if model is not None else make_model()
    optimizer = optimizer if optimizer is not None else make_optimizer(model.parameters())
    losses = []
    for step in range(first_step, first_step + steps):
        x, y = window(step, rows)
        loss = F.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return model, losses


def boosted_steps(model: nn.Module, wrapper: ColossalAIOptimWrapper, steps: int, rank: int, world: int,
                  k: int, first_step: int = 0) -> list[float]:  # fmt: skip
    """Train through the wrapper: k micro-batches per step, forward and backward inside optim_context.

    Returns the window losses (mean over the window's micro-batches on this rank).
    """
    losses = []
    for step in range(first_step, first_step + steps):
        total = 0.0
        for m in range(k):
            x, y = micro_batch(step, m, rank, world, k)
            with wrapper.optim_context(model):
                loss = F.mse_loss(model(x).float(), y)
                wrapper.update_params(loss)
            total += loss.item()
        losses.append(total / k)
    return losses


def boost(plugin: Any, mixed_precision: Any = None, k: int = 1, optimizer: str = "AdamW",
          **wrapper_kwargs: Any) -> tuple[Booster, nn.Module, ColossalAIOptimWrapper]:  # fmt: skip
    booster = Booster(mixed_precision=mixed_precision, plugin=plugin)
    model = make_model()
    opt = make_optimizer(model.parameters(), optimizer)
    model, opt, *_ = booster.boost(model, opt)
    wrapper = ColossalAIOptimWrapper(opt, booster=booster, accumulative_counts=k, **wrapper_kwargs)
    return booster, model, wrapper


def full_params(booster: Booster, model: nn.Module) -> dict[str, torch.Tensor]:
    """Full fp32 CPU parameters of a boosted model (gathered for FSDP2; collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from stepforge.core import WrappedModel

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    sd = get_model_state_dict(model.unwrap() if isinstance(model, WrappedModel) else model, options=options)
    return {k: v.detach().float().clone() for k, v in sd.items()}
