# SPDX-License-Identifier: Apache-2.0
"""Convergence on a small real problem: an MLP on scikit-learn's bundled digits (no download).

Lamb and Lars must reach the test accuracy of ``torch.optim.SGD`` (momentum 0.9) with its best learning rate
from a small grid, within one percentage point.
"""

from __future__ import annotations

import functools

import pytest
import torch

from stepforge.optim import Lamb, Lars

datasets = pytest.importorskip("sklearn.datasets")
model_selection = pytest.importorskip("sklearn.model_selection")

EPOCHS = 15
BATCH = 64


@functools.cache
def _data():
    x, y = datasets.load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = model_selection.train_test_split(
        x, y, test_size=0.25, random_state=0, stratify=y
    )
    mean, std = x_tr.mean(0), x_tr.std(0) + 1e-6
    as_t = functools.partial(torch.tensor, dtype=torch.float32)
    return as_t((x_tr - mean) / std), torch.tensor(y_tr), as_t((x_te - mean) / std), torch.tensor(y_te)


def _accuracy(make_optimizer) -> float:
    x_tr, y_tr, x_te, y_te = _data()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    opt = make_optimizer(model)
    gen = torch.Generator().manual_seed(1)
    for _ in range(EPOCHS):
        order = torch.randperm(len(x_tr), generator=gen)
        for i in range(0, len(order), BATCH):
            idx = order[i : i + BATCH]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x_tr[idx]), y_tr[idx]).backward()
            opt.step()
    with torch.no_grad():
        return (model(x_te).argmax(1) == y_te).float().mean().item()


@functools.cache
def _tuned_sgd() -> float:
    return max(
        _accuracy(lambda m, lr=lr: torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9))
        for lr in (0.003, 0.01, 0.03, 0.1)
    )


def test_tuned_sgd_learns_the_task():
    assert _tuned_sgd() > 0.9


@pytest.mark.parametrize(
    "make_optimizer",
    [
        pytest.param(lambda m: Lamb(m.parameters(), lr=0.005, weight_decay=0.01), id="Lamb"),
        pytest.param(lambda m: Lamb.fused_lamb(m.parameters(), lr=0.005), id="Lamb.fused_lamb"),
        pytest.param(
            lambda m: Lars(
                m.parameters(),
                lr=1.0,
                momentum=0.9,
                weight_decay=1e-4,
                exclude_from_adaptation=Lars.exclude_bias_and_norm,
            ),
            id="Lars",
        ),
    ],
)
def test_reaches_tuned_sgd_accuracy(make_optimizer):
    accuracy = _accuracy(make_optimizer)
    assert accuracy >= _tuned_sgd() - 0.01, f"accuracy {accuracy:.3f} vs tuned SGD {_tuned_sgd():.3f}"
