# SPDX-License-Identifier: Apache-2.0
"""Small seeded models and regression data shared by the test suites, and parameter snapshots to compare.

Every builder seeds torch's global generator itself (``seed``), so two calls give bit-identical models: the run
under test and its reference start from the same weights. Data comes from private generators and never touches
the global one.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from stepforge.core.torch_compat import is_dtensor

__all__ = [
    "BlockNet",
    "assert_params_close",
    "block_net",
    "mse",
    "regression_batch",
    "snapshot",
    "tanh_mlp",
]


def tanh_mlp(d_in: int = 4, hidden: int = 8, d_out: int = 1, *, seed: int = 0) -> nn.Sequential:
    """``Linear(d_in, hidden) -> Tanh -> Linear(hidden, d_out)``, float32, initialised after ``manual_seed(seed)``.

    Modules ``[0]`` and ``[2]`` are the two linear layers (FSDP2 tests shard them one by one).
    """
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, d_out))


class BlockNet(nn.Module):
    """``blocks`` (a ``ModuleList`` of ``Linear`` + tanh, the unit FSDP2 plugins shard one by one) and a ``head``.

    Input ``(batch, d_in)`` float32, output ``(batch, 1)``.
    """

    def __init__(self, d_in: int = 6, width: int = 16, depth: int = 2) -> None:
        super().__init__()
        sizes = [d_in] + [width] * depth
        self.blocks = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(sizes))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        out: torch.Tensor = self.head(x)
        return out


def block_net(seed: int = 0, d_in: int = 6, width: int = 16, depth: int = 2) -> BlockNet:
    """A :class:`BlockNet` initialised after ``manual_seed(seed)``."""
    torch.manual_seed(seed)
    return BlockNet(d_in, width, depth)


def regression_batch(
    rows: int, d_in: int = 4, d_out: int = 1, *, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, y)``: ``x`` of shape ``(rows, d_in)`` and ``y`` of shape ``(rows, d_out)``, standard normal float32,
    drawn in that order from a generator seeded with ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, d_in, generator=gen), torch.randn(rows, d_out, generator=gen)


def mse(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean squared error of ``model(x)`` against ``y`` (a 0-d tensor)."""
    loss: torch.Tensor = (model(x) - y).pow(2).mean()
    return loss


def snapshot(params: nn.Module | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Detached copies of a module's parameters (or of the given tensors), in order; DTensors gathered whole."""
    tensors = params.parameters() if isinstance(params, nn.Module) else params
    out = []
    for p in tensors:
        full = p.full_tensor() if is_dtensor(p) else p
        out.append(full.detach().clone())
    return out


def assert_params_close(
    got: nn.Module | Sequence[torch.Tensor],
    want: Sequence[torch.Tensor],
    *,
    atol: float = 1e-6,
    rtol: float = 1e-5,
    what: str = "",
) -> None:
    """``assert_close`` parameter by parameter (a module's parameters, or tensors); the message names the index."""
    got_tensors = snapshot(got) if isinstance(got, nn.Module) else list(got)
    if len(got_tensors) != len(want):
        raise AssertionError(f"{what}: {len(got_tensors)} parameters, expected {len(want)}")
    for i, (a, b) in enumerate(zip(got_tensors, want, strict=True)):

        def message(m: str, i: int = i) -> str:
            return f"{what} parameter {i}: {m}"

        torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=message)
