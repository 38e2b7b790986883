# SPDX-License-Identifier: Apache-2.0
"""A small training run through Strategy, shared by the strategy tests (importable by spawned ranks)."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from stepforge.strategy import Strategy

ITERS = 8
COUNTS = 3


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, 16), nn.Dropout(0.25), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)
    )


def batch(iteration: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * iteration + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def make_strategy(work: str, plugin: Any = None, **kwargs: Any) -> Strategy:
    return Strategy(
        plugin=plugin,
        work_dir=work,
        experiment_name="case",
        env_kwargs=dict(randomness=dict(seed=kwargs.pop("seed", 7))),
        log_kwargs=dict(console=False),
        **kwargs,
    )


def prepare(strategy: Strategy, model_seed: int = 0, optimizer: str = "AdamW") -> tuple[Any, Any, Any]:
    return strategy.prepare(
        make_model(model_seed),
        optim_wrapper=dict(
            optimizer=dict(type=optimizer, lr=0.05, weight_decay=0.01), accumulative_counts=COUNTS
        ),
        param_scheduler=[
            dict(type="LinearLR", start_factor=0.2, begin=0, end=3, by_epoch=False),
            dict(type="CosineAnnealingLR", eta_min=0.001, begin=3, end=ITERS, by_epoch=False),
        ],
        dispatch_kwargs=dict(max_iters=ITERS),
    )


def train(strategy: Strategy, start: int, stop: int, rank: int) -> list[float]:
    model, wrapper, schedulers = strategy._components()
    model.train()
    losses = []
    for it in range(start, stop):
        x, y = batch(it, rank)
        with wrapper.optim_context(model):
            loss = (model(x) - y).square().mean()
        wrapper.update_params(loss)
        for s in schedulers:
            s.step()
        losses.append(loss.item())
    return losses


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in sd.items()}


def ckpt(work: str, name: str) -> str:
    return os.path.join(work, name)
