# SPDX-License-Identifier: Apache-2.0
"""stepforge.testing.models: seeded models and data are reproducible, snapshots are copies, comparisons fail."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from stepforge.testing.models import (
    BlockNet,
    assert_params_close,
    block_net,
    mse,
    regression_batch,
    snapshot,
    tanh_mlp,
)


def test_tanh_mlp_is_reproducible_per_seed_and_shaped_as_asked():
    a, b, c = tanh_mlp(6, 32, 3, seed=0), tanh_mlp(6, 32, 3, seed=0), tanh_mlp(6, 32, 3, seed=1)
    assert [tuple(p.shape) for p in a.parameters()] == [(32, 6), (32,), (3, 32), (3,)]
    assert isinstance(a[0], nn.Linear) and isinstance(a[1], nn.Tanh) and isinstance(a[2], nn.Linear)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a[0].weight, c[0].weight)
    # the same weights as the inline definition the test suites used before
    torch.manual_seed(0)
    inline = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), inline.parameters(), strict=True))


def test_block_net_blocks_head_and_forward():
    net = block_net(3, d_in=6, width=16, depth=2)
    assert isinstance(net, BlockNet) and isinstance(net.blocks, nn.ModuleList) and len(net.blocks) == 2
    x = torch.randn(5, 6)
    expected = net.head(torch.tanh(net.blocks[1](torch.tanh(net.blocks[0](x)))))
    assert torch.equal(net(x), expected) and net(x).shape == (5, 1)
    again = block_net(3, d_in=6, width=16, depth=2)
    assert all(torch.equal(p, q) for p, q in zip(net.parameters(), again.parameters(), strict=True))


def test_regression_batch_is_seeded_and_leaves_the_global_generator_alone():
    torch.manual_seed(5)
    before = torch.random.get_rng_state()
    x, y = regression_batch(7, 4, 2, seed=11)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert x.shape == (7, 4) and y.shape == (7, 2) and x.dtype == torch.float32
    gen = torch.Generator().manual_seed(11)
    assert torch.equal(x, torch.randn(7, 4, generator=gen)) and torch.equal(
        y, torch.randn(7, 2, generator=gen)
    )
    assert not torch.equal(regression_batch(7, 4, 2, seed=12)[0], x)


def test_mse():
    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(2.0)
    x, y = torch.tensor([[1.0], [3.0]]), torch.tensor([[0.0], [0.0]])
    assert mse(model, x, y).item() == pytest.approx((4.0 + 36.0) / 2)


def test_snapshot_is_a_detached_copy():
    model = tanh_mlp(seed=0)
    saved = snapshot(model)
    with torch.no_grad():
        model[0].weight.add_(1.0)
    assert not torch.equal(saved[0], model[0].weight) and not saved[0].requires_grad
    assert torch.equal(snapshot([model[0].weight])[0], model[0].weight)


def test_assert_params_close_names_the_parameter_and_fails_on_count():
    model = tanh_mlp(seed=0)
    want = snapshot(model)
    assert_params_close(model, want)
    want[2] = want[2] + 1e-3
    with pytest.raises(AssertionError, match="run parameter 2"):
        assert_params_close(model, want, what="run")
    with pytest.raises(AssertionError, match="3 parameters, expected 4"):
        assert_params_close(list(model.parameters())[:3], snapshot(model))
