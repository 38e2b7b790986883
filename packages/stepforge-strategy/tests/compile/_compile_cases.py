# SPDX-License-Identifier: Apache-2.0
"""Shared by the compile tests: a small residual model whose blocks FSDP2 shards one by one, a torch.compile
backend that counts the compiled graphs and their runs, and one boosted training run (eager or compiled)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from _cases import D_IN, make_optimizer, micro_batch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from stepforge.strategy import Booster, ColossalAIOptimWrapper
from stepforge.strategy.compile import user_module

WIDTH = 16
STEPS, K = 20, 2  # optimizer steps, micro-batches accumulated per step


class Block(nn.Module):
    """Pre-norm residual MLP block: LayerNorm, Linear, GELU, Linear (pointwise ops and a reduction for Inductor
    to fuse, so a compiled block really runs generated code)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    """Input projection, two identical :class:`Block` (the FSDP2 units; one compiled graph serves both), head."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(D_IN, WIDTH)
        self.blocks = nn.ModuleList(Block(WIDTH) for _ in range(2))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(x)
        return out

    def train_step(self, x: torch.Tensor) -> torch.Tensor:
        """Another method, to compile through ``target="train_step"``."""
        return self.forward(x) * 2.0


def make_net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


class CountingBackend:
    """A ``torch.compile`` backend that hands each graph to ``inner`` (``"inductor"``, ``"aot_eager"``...) and
    counts the graphs compiled and the calls of the compiled code (forward calls; each compiled forward's
    backward is the compiled backward)."""

    def __init__(self, inner: str) -> None:
        self.inner = inner
        self.graphs = 0
        self.runs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        compiled = torch._dynamo.lookup_backend(self.inner)(gm, example_inputs)
        self.graphs += 1

        def run(*args: Any) -> Any:
            self.runs += 1
            return compiled(*args)

        return run


def boost_net(plugin: Any, mixed_precision: Any, k: int, compile: Any) -> tuple[Booster, nn.Module, Any]:
    """A fresh :func:`make_net` boosted with AdamW and ``compile``; the ColossalAIOptimWrapper accumulates ``k``."""
    booster = Booster(mixed_precision=mixed_precision, plugin=plugin)
    net = make_net()
    model, opt, *_ = booster.boost(net, make_optimizer(net.parameters()), compile=compile)
    return booster, model, ColossalAIOptimWrapper(opt, booster=booster, accumulative_counts=k)


def train(
    model: nn.Module, wrapper: Any, steps: int, rank: int, world: int, k: int, first: int = 0
) -> list[float]:
    """``steps`` optimizer steps of ``k`` micro-batches (forward and backward inside ``optim_context``); returns
    each window's mean loss on this rank."""
    losses = []
    for step in range(first, first + steps):
        total = 0.0
        for m in range(k):
            x, y = micro_batch(step, m, rank, world, k)
            with wrapper.optim_context(model):
                loss = F.mse_loss(model(x).float(), y)
                wrapper.update_params(loss)
            total += loss.item()
        losses.append(total / k)
    return losses


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict of the user's model inside a boosted ``model``, on every rank (FSDP2 shards gathered;
    collective), under the eager model's names."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=False)
    state = get_model_state_dict(user_module(model), options=options)
    return {k: v.detach().clone() for k, v in state.items()}


def max_relative_difference(got: list[float], expected: list[float]) -> float:
    """The largest ``|got - expected| / |expected|`` over two equally long loss curves."""
    assert len(got) == len(expected)
    return max(abs(g - e) / abs(e) for g, e in zip(got, expected, strict=True))
