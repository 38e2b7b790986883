# SPDX-License-Identifier: Apache-2.0
"""Shared pieces of the LowLevelZeroOptimizer tests: a model, its data, the single-process reference.

The reference is the plain inner optimizer stepping the whole model on the *concatenated* batch of all ranks
(what DDP computes): with equal per-rank batch sizes, the mean loss over the full batch has the gradient that
the ranks' averaged gradients equal. For low-precision working params the reference keeps fp32 masters by
hand (copy grad to fp32, step the fp32 copy, cast back), the textbook mixed-precision recipe.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from stepforge.core import build_optimizer

GLOBAL_BATCH = 8
IN, HIDDEN, OUT = 7, 13, 5  # odd sizes: every parameter needs padding at 2 and 4 ranks


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))
    return model.to(dtype)


def param_groups(model: nn.Module) -> list[dict[str, Any]]:
    """Two groups: weights with weight decay, biases without (and a different lr)."""
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": weights}, {"params": biases, "weight_decay": 0.0, "lr": 0.02}]


def batch(step: int, micro: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """The global (all-rank) batch of one micro-batch; rank r takes rows [r*B/W, (r+1)*B/W)."""
    gen = torch.Generator().manual_seed(1000 + 17 * step + micro)
    x = torch.randn(GLOBAL_BATCH, IN, generator=gen)
    y = torch.randn(GLOBAL_BATCH, OUT, generator=gen)
    return x.to(dtype), y.to(dtype)


def local_rows(rank: int, world: int) -> slice:
    per = GLOBAL_BATCH // world
    return slice(rank * per, (rank + 1) * per)


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).mean()


def micro_batches(step: int, accum: int, rank: int, world: int, dtype: torch.dtype) -> Iterator[Any]:
    rows = local_rows(rank, world)
    for micro in range(accum):
        x, y = batch(step, micro, dtype)
        yield x[rows], y[rows]


def optimizer_cfg(name: str) -> dict[str, Any]:
    if name == "SGD":
        return dict(type="SGD", lr=0.05, momentum=0.9, weight_decay=0.01)
    return dict(type=name, lr=0.01, weight_decay=0.01)


def reference_run(
    opt_name: str,
    steps: int,
    accum: int = 1,
    dtype: torch.dtype = torch.float32,
    max_norm: float = 0.0,
    start: int = 0,
    model: nn.Module | None = None,
    state: dict | None = None,
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The single-process run on the concatenated batch (fp32 masters by hand for low precision)."""
    model = make_model(dtype=dtype) if model is None else model
    masters = [
        p.detach().float().clone().requires_grad_(p.dtype != torch.float32) for p in model.parameters()
    ]
    work = list(model.parameters())
    if dtype == torch.float32:
        masters = work
    groups = param_groups(model)
    index = {id(p): i for i, p in enumerate(work)}
    master_groups = [{**g, "params": [masters[index[id(p)]] for p in g["params"]]} for g in groups]
    opt = build_optimizer(optimizer_cfg(opt_name), master_groups)
    if state is not None:
        opt.load_state_dict(state)
    for step in range(start, start + steps):
        for micro in range(accum):
            x, y = batch(step, micro, dtype)
            (loss_fn(model, x, y) / accum).backward()
        if dtype != torch.float32:
            for m, p in zip(masters, work, strict=True):
                m.grad = p.grad.float()
                p.grad = None
        if max_norm:
            torch.nn.utils.clip_grad_norm_(masters, max_norm)
        opt.step()
        opt.zero_grad()
        if dtype != torch.float32:
            with torch.no_grad():
                for m, p in zip(masters, work, strict=True):
                    p.copy_(m.to(dtype))
    return model, opt


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
