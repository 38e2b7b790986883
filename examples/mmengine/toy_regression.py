# SPDX-License-Identifier: Apache-2.0
"""A small regression model and data set for the mmengine example (registered in mmengine's MODELS/DATASETS).

The data are generated locally from a seeded generator: ``y = x @ w_true + 0.1 * noise``.
"""

from __future__ import annotations

import torch
from mmengine.model import BaseModel
from mmengine.registry import DATASETS, MODELS
from torch import nn
from torch.utils.data import Dataset

__all__ = ["ToyRegressionDataset", "ToyRegressor"]


@DATASETS.register_module()
class ToyRegressionDataset(Dataset):
    """``size`` samples ``dict(inputs=float32[features], targets=float32[1])`` from a fixed seed."""

    def __init__(self, size: int = 64, features: int = 8, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.inputs = torch.randn(size, features, generator=g)
        w_true = torch.randn(features, 1, generator=g)
        self.targets = self.inputs @ w_true + 0.1 * torch.randn(size, 1, generator=g)

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"inputs": self.inputs[index], "targets": self.targets[index]}


@MODELS.register_module()
class ToyRegressor(BaseModel):
    """A two-layer MLP with dropout (so a resume must restore the RNG to continue identically)."""

    def __init__(self, features: int = 8, hidden: int = 16, dropout: float = 0.1) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(features, hidden), nn.Tanh(), nn.Dropout(dropout), nn.Linear(hidden, 1)
        )

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor | None = None, mode: str = "tensor"):
        out = self.net(inputs)
        if mode == "loss":
            return {"loss": nn.functional.mse_loss(out, targets)}
        if mode == "predict":
            return [out]
        return out
