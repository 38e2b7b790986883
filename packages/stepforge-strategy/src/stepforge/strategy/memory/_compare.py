# SPDX-License-Identifier: Apache-2.0
"""Several plugins estimated side by side, from command-line plugin specs (the command, the "What fits" page and
``plugin="auto"`` share it)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ._estimate import Estimate, estimate, shared_traces
from ._specs import parse_plugin

__all__ = ["estimate_plugins"]


def estimate_plugins(
    model: torch.nn.Module,
    plugins: Sequence[str],
    *,
    world_size: int,
    precision: str,
    optimizer: Mapping[str, Any] | torch.optim.Optimizer | None,
    inputs: Any = None,
    device: str = "cuda",
    backend: str | None = None,
    rank: int = 0,
    accumulation_steps: int = 1,
    activation_checkpointing: bool = False,
) -> list[Estimate]:
    """One :class:`Estimate` per plugin spec (``single`` is left out above one rank); the activations are traced
    once per compute dtype."""
    out = []
    with shared_traces():
        for spec in plugins:
            name, kwargs = parse_plugin(spec)
            if name == "single" and world_size > 1:
                continue
            out.append(
                estimate(
                    model,
                    name,
                    world_size=1 if name == "single" else world_size,
                    precision=precision,
                    optimizer=optimizer,
                    inputs=inputs,
                    rank=rank,
                    device=device,
                    backend=backend,
                    accumulation_steps=accumulation_steps,
                    activation_checkpointing=activation_checkpointing,
                    **kwargs,
                )
            )
    return out
