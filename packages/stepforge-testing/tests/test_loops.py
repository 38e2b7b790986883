# SPDX-License-Identifier: Apache-2.0
"""stepforge.testing.loops: the reference loops compute what they claim (checked against hand-written math)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from stepforge.testing.loops import (
    TOLERANCES,
    assert_trajectories_close,
    random_grads,
    reference_windows,
    run_steps,
    step_with_random_grads,
    trajectory_params,
)


def _scalar_model(w: float) -> nn.Linear:
    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(w)
    return model


# loss = mean((w x - y)^2) over rows: d/dw = 2 mean(x (w x - y))
X1, Y1 = torch.tensor([[1.0], [2.0]]), torch.tensor([[0.0], [1.0]])
X2, Y2 = torch.tensor([[3.0]]), torch.tensor([[2.0]])


def _grad(w: float, xs: list[float], ys: list[float]) -> float:
    return 2 * sum(x * (w * x - y) for x, y in zip(xs, ys, strict=True)) / len(xs)


def test_reference_windows_concatenates_each_window():
    model = _scalar_model(0.5)
    out = reference_windows(model, torch.optim.SGD(model.parameters(), lr=0.1), [[(X1, Y1), (X2, Y2)]])
    expected = 0.5 - 0.1 * _grad(0.5, [1.0, 2.0, 3.0], [0.0, 1.0, 2.0])
    assert out[0].item() == pytest.approx(expected)


def test_reference_windows_sums_micro_batch_gradients_and_clips():
    model = _scalar_model(0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = reference_windows(model, opt, [[(X1, Y1), (X2, Y2)]], concatenate=False)
    summed = _grad(0.5, [1.0, 2.0], [0.0, 1.0]) + _grad(0.5, [3.0], [2.0])
    assert out[0].item() == pytest.approx(0.5 - 0.1 * summed)
    model = _scalar_model(0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    norms: list[float] = []
    out = reference_windows(model, opt, [[(X1, Y1)], [(X2, Y2)]], max_norm=0.01, norms=norms)
    # both gradients exceed 0.01 in magnitude: each step moves by lr * 0.01 against the gradient's sign
    g1 = _grad(0.5, [1.0, 2.0], [0.0, 1.0])
    w1 = 0.5 - 0.1 * 0.01 * (1 if g1 > 0 else -1)
    g2 = _grad(w1, [3.0], [2.0])
    assert out[0].item() == pytest.approx(w1 - 0.1 * 0.01 * (1 if g2 > 0 else -1), abs=1e-6)
    assert norms == pytest.approx([abs(g1), abs(g2)])


def test_random_grads_and_steps_are_seeded():
    params = [torch.zeros(3, requires_grad=True), torch.zeros(2, dtype=torch.float64, requires_grad=True)]
    random_grads(params, 4)
    gen = torch.Generator().manual_seed(4)
    assert torch.equal(params[0].grad, torch.randn(3, generator=gen))
    assert params[1].grad.dtype == torch.float64
    # SGD with lr=1: the parameters end at minus the sum of the gradients drawn for steps seed, seed+1
    step_with_random_grads(torch.optim.SGD(params, lr=1.0), params, 2, seed=7)
    total = torch.randn(3, generator=torch.Generator().manual_seed(7))
    total += torch.randn(3, generator=torch.Generator().manual_seed(8))
    torch.testing.assert_close(params[0].detach(), -total)


def test_run_steps_with_skips_and_the_trajectory_check():
    start = trajectory_params([(4,), (2, 2)], torch.float32, seed=3)
    assert all(p.requires_grad and p.dtype == torch.float32 for p in start)
    frozen = run_steps(lambda ps: torch.optim.SGD(ps, lr=1.0), [(4,), (2, 2)], torch.float32, steps=3, seed=3,
                       skip=lambda step, index: index == 1)  # fmt: skip
    assert torch.equal(frozen[1], start[1].detach()) and not torch.equal(frozen[0], start[0].detach())
    again = run_steps(lambda ps: torch.optim.SGD(ps, lr=1.0), [(4,), (2, 2)], torch.float32, steps=3, seed=3)
    # the same seed gives the same trajectory, run after run
    twin = run_steps(lambda ps: torch.optim.SGD(ps, lr=1.0), [(4,), (2, 2)], torch.float32, steps=3, seed=3)
    assert_trajectories_close(again, twin, torch.float32)
    rtol, atol = TOLERANCES[torch.float32]
    with pytest.raises(AssertionError):
        assert_trajectories_close(again, [t + 100 * atol + t.abs() * 10 * rtol for t in again], torch.float32)
