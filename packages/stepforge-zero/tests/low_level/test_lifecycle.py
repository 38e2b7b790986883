# SPDX-License-Identifier: Apache-2.0
"""``LowLevelZeroOptimizer``'s lifetime: its gradient hooks leave with it (``__del__``, as ColossalAI's do) or
at an explicit, idempotent :meth:`close`; after either, a backward fills ``weight.grad`` as without ZeRO and
the fp32 masters are freed. One process (no group: world size 1)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from stepforge.zero.low_level import LowLevelZeroOptimizer


def _model() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(4, 3).to(torch.bfloat16)


def _backward(model: nn.Linear) -> None:
    model(torch.ones(2, 4, dtype=torch.bfloat16)).sum().backward()


def test_hooks_leave_with_the_optimizer_and_its_masters_are_freed() -> None:
    model = _model()
    opt = LowLevelZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    master = weakref.ref(opt.layout.slots[0].master)
    _backward(model)
    assert model.weight.grad is None  # the live optimizer's hook took the gradient into its piece
    del opt
    gc.collect()
    assert master() is None  # nothing keeps the dead optimizer's masters alive
    _backward(model)
    # d(sum(x W^T + b))/dW = column sums of x = 2 for every element
    assert model.weight.grad is not None
    assert torch.equal(model.weight.grad, torch.full((3, 4), 2.0, dtype=torch.bfloat16))


def test_close_removes_the_hooks_and_is_idempotent() -> None:
    model = _model()
    opt = LowLevelZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), stage=2)
    opt.close()
    opt.close()  # a second close changes nothing and raises nothing
    assert opt.closed
    _backward(model)
    assert torch.equal(model.bias.grad, torch.full((3,), 2.0, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="close"):
        opt.step()
    del opt
    gc.collect()  # __del__ after close: nothing left to remove, no error


def test_close_waits_for_reductions_and_drops_the_gradient_pieces() -> None:
    model = _model()
    opt = LowLevelZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    _backward(model)
    assert opt.has_reduced_grads
    opt.close()
    assert not opt.has_reduced_grads
    assert all(slot.grad is None for slot in opt.layout.slots)
