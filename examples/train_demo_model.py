# SPDX-License-Identifier: Apache-2.0
"""The data and model of ``train_demo.py``: scikit-learn's digits as tensors and a pre-norm residual MLP."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["ResidualBlock", "ResidualMLP", "load_digits_tensors"]


def load_digits_tensors(seed: int, *, train_limit: int | None = None) -> tuple[torch.Tensor, ...]:
    """scikit-learn's digits, split 80/20 (stratified) and standardised with the training statistics.

    Returns:
        ``x_train (N, 64) float32, y_train (N,) int64, x_test (M, 64) float32, y_test (M,) int64``.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x_tr, x_te, y_tr, y_te = train_test_split(
        data.data, data.target, test_size=0.2, random_state=seed, stratify=data.target
    )
    if train_limit is not None:
        x_tr, y_tr = x_tr[:train_limit], y_tr[:train_limit]
    mean, std = x_tr.mean(axis=0), x_tr.std(axis=0) + 1e-3  # some border pixels are always 0
    x_tr, x_te = (x_tr - mean) / std, (x_te - mean) / std
    as_x = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    as_y = lambda a: torch.tensor(a, dtype=torch.int64)  # noqa: E731
    return as_x(x_tr), as_y(y_tr), as_x(x_te), as_y(y_te)


class ResidualBlock(nn.Module):
    """``x + W2 gelu(W1 layernorm(x))`` on ``(batch, width)``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


class ResidualMLP(nn.Module):
    """Pre-norm residual MLP classifier: ``(batch, in_features) -> (batch, classes)`` logits."""

    def __init__(self, in_features: int = 64, width: int = 256, depth: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Linear(in_features, width)
        self.blocks = nn.Sequential(*(ResidualBlock(width) for _ in range(depth)))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.stem(x))))
