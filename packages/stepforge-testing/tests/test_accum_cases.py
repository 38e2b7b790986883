# SPDX-License-Identifier: Apache-2.0
"""The accumulation test cases: the big-batch reference against a step written out by hand, the data helpers'
determinism and errors, and the ColossalAI loop order."""

from __future__ import annotations

import pytest
import torch

from stepforge.testing.accum_cases import (
    assert_params_close,
    big_batch_reference,
    mse,
    param_copies,
    regression_data,
    regression_dataset,
    split_batches,
    tiny_mlp,
    train_colossalai_order,
)


def test_tiny_mlp_and_data_are_deterministic_and_shaped() -> None:
    a, b = tiny_mlp(3), tiny_mlp(3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a[0].weight, tiny_mlp(4)[0].weight)
    x, y = regression_data(5, seed=2)
    assert x.shape == (5, 4) and y.shape == (5, 1) and x.dtype == torch.float32
    assert torch.equal(x, regression_data(5, seed=2)[0])
    assert torch.equal(regression_dataset(5, seed=2).tensors[1], y)
    with pytest.raises(ValueError, match="n must be >= 1"):
        regression_data(0)


def test_split_batches_is_consecutive_and_checks_sizes() -> None:
    x, y = regression_data(6)
    parts = split_batches(x, y, [1, 3, 2])
    assert [len(p[0]) for p in parts] == [1, 3, 2]
    assert torch.equal(torch.cat([p[0] for p in parts]), x) and torch.equal(parts[2][1], y[4:6])
    with pytest.raises(ValueError, match="sum to 7 but there are only 6"):
        split_batches(x, y, [4, 3])


def test_big_batch_reference_is_one_sgd_step_per_window_on_the_concatenation() -> None:
    x, y = regression_data(6)
    windows = [split_batches(x[:4], y[:4], [1, 3]), split_batches(x[4:], y[4:], [2])]
    model = tiny_mlp()
    for xs, ys in ((x[:4], y[:4]), (x[4:], y[4:])):  # written out: p -= lr * grad of the window mean
        model.zero_grad()
        mse(model, xs, ys).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
    expected = param_copies(model)
    got = big_batch_reference(windows, lr=0.1)
    assert_params_close(got, expected, atol=1e-7, rtol=1e-6)
    start = param_copies(tiny_mlp())
    assert max((g - s).abs().max().item() for g, s in zip(got, start, strict=True)) > 1e-3
    clipped = big_batch_reference(windows, lr=0.1, clip=lambda ps: torch.nn.utils.clip_grad_norm_(ps, 1e-3))
    step = [(c - s).norm() ** 2 for c, s in zip(clipped, start, strict=True)]
    assert torch.stack(step).sum().sqrt() <= 2 * 0.1 * 1e-3 + 1e-7  # two steps, each of norm <= lr * 1e-3
    with pytest.raises(AssertionError):
        assert_params_close(got, start, what="moved")


def test_train_colossalai_order_calls_in_the_engine_order() -> None:
    calls: list[str] = []

    class Optim:
        def zero_grad(self):
            calls.append("zero_grad")

        def optim_context(self):
            calls.append("context")
            return torch.enable_grad()

        def backward(self, loss):
            calls.append(f"backward:{loss.dim()}")

        def step(self):
            calls.append("step")

    class Handler:
        def handle_gradient(self):
            calls.append("handler")

    class Sched:
        def step(self):
            calls.append("sched")

    x, y = regression_data(2)
    train_colossalai_order([(x, y)], tiny_mlp(), Optim(), Sched(), [Handler()], epochs=2)
    assert calls == ["zero_grad", "context", "backward:0", "handler", "step", "sched"] * 2
