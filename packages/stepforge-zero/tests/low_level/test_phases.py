# SPDX-License-Identifier: Apache-2.0
"""``LowLevelZeroOptimizer.observe_phases``: each phase of a CPU-offloaded step runs inside the observer's context
and brackets the work it names (the gradient lands in the host pieces inside ``grad_to_pieces``, the masters
change inside ``inner_step``, the working parameters inside ``param_gather``); removing the observer stops the
calls and the step's result does not depend on it. One process (no group: world size 1)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from stepforge.zero.low_level import LowLevelZeroOptimizer
from stepforge.zero.phases import PHASES


def _model() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(4, 3).to(torch.bfloat16)


def _backward(model: nn.Linear) -> None:
    model(torch.ones(2, 4, dtype=torch.bfloat16)).sum().backward()


class _Recorder:
    """Records ``(phase, "enter"|"exit", snapshot)``: the weight's gradient piece, master and working values."""

    def __init__(self, model: nn.Linear, opt: LowLevelZeroOptimizer) -> None:
        self.model, self.opt = model, opt
        self.events: list[tuple[str, str, dict[str, Any]]] = []

    def _snapshot(self) -> dict[str, Any]:
        slot = self.opt.layout.slot_of(self.model.weight)
        assert slot is not None
        return {
            "grad": None if slot.grad is None else slot.grad.clone(),
            "master": slot.master.clone(),
            "working": self.model.weight.detach().clone(),
        }

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self.events.append((name, "enter", self._snapshot()))
        yield
        self.events.append((name, "exit", self._snapshot()))


def _offloaded(model: nn.Linear) -> LowLevelZeroOptimizer:
    # a bucket per gradient: each lands in its piece from its own backward hook
    return LowLevelZeroOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.5), stage=2, cpu_offload=True, reduce_bucket_size=1
    )


def test_each_phase_of_an_offloaded_step_brackets_the_work_it_names() -> None:
    model = _model()
    opt = _offloaded(model)
    rec = _Recorder(model, opt)
    opt.observe_phases(rec)
    _backward(model)
    opt.step()
    names = [(name, kind) for name, kind, _ in rec.events]
    # weight and bias each land in their piece during backward, then the step's two phases in order
    assert names == [
        ("grad_to_pieces", "enter"), ("grad_to_pieces", "exit"),
        ("grad_to_pieces", "enter"), ("grad_to_pieces", "exit"),
        ("inner_step", "enter"), ("inner_step", "exit"),
        ("param_gather", "enter"), ("param_gather", "exit"),
    ]  # fmt: skip
    assert {name for name, _ in names} == set(PHASES)
    by = {(name, kind): snap for name, kind, snap in rec.events}
    weight_landing = [
        i for i, (_, kind, snap) in enumerate(rec.events) if kind == "exit" and snap["grad"] is not None
    ]
    first_exit = weight_landing[0]
    assert rec.events[first_exit - 1][2]["grad"] is None  # the weight's piece was empty when its phase began
    # d(sum(x W^T + b))/dW = column sums of x = 2, kept in fp32 on the host
    assert torch.equal(rec.events[first_exit][2]["grad"], torch.full((12,), 2.0))
    # the masters change inside inner_step (SGD: w - 0.5 * 2 = w - 1), the bf16 weights inside param_gather
    before, after = by[("inner_step", "enter")]["master"], by[("inner_step", "exit")]["master"]
    assert torch.equal(after, before - 1.0)
    assert torch.equal(by[("param_gather", "enter")]["working"], by[("inner_step", "enter")]["working"])
    assert torch.equal(by[("param_gather", "exit")]["working"], after.view(3, 4).to(torch.bfloat16))


def test_without_an_observer_nothing_is_called_and_the_step_is_the_same() -> None:
    observed, plain = _model(), _model()
    opt_observed, opt_plain = _offloaded(observed), _offloaded(plain)
    rec = _Recorder(observed, opt_observed)
    opt_observed.observe_phases(rec)
    for model, opt in ((observed, opt_observed), (plain, opt_plain)):
        _backward(model)
        opt.step()
        opt.zero_grad()
    seen = len(rec.events)
    assert seen == 8
    opt_observed.observe_phases(None)
    for model, opt in ((observed, opt_observed), (plain, opt_plain)):
        _backward(model)
        opt.step()
        opt.zero_grad()
    assert len(rec.events) == seen  # removed: no further calls
    assert torch.equal(observed.weight, plain.weight) and torch.equal(observed.bias, plain.bias)
