# SPDX-License-Identifier: Apache-2.0
"""GradAccumLrSchedulerByStep is a torch ``_LRScheduler``/``LRScheduler`` (as ColossalAI's) with no side effect at
construction, and counts the windows of the accumulating optimizer it is linked to."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, SequentialLR, StepLR, _LRScheduler

from stepforge.accum import (
    AccumulatingOptimizer,
    GradAccumLrSchedulerByStep,
    GradAccumOptimizer,
    OptimWrapper,
)


def _opt(lr: float = 1.0) -> torch.optim.SGD:
    return torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=lr)


def test_is_an_lr_scheduler_and_constructing_it_changes_nothing() -> None:
    opt = _opt()
    inner = StepLR(opt, step_size=1, gamma=0.5)
    step_fn = opt.step
    sched = GradAccumLrSchedulerByStep(inner, 3)
    assert isinstance(sched, LRScheduler)
    # ColossalAI's GradAccumLrSchedulerByStep derives from _LRScheduler and its suite checks that name
    assert isinstance(sched, _LRScheduler)
    assert opt.param_groups[0]["lr"] == 1.0 and inner.last_epoch == 0  # no extra initial step
    assert opt.step == step_fn  # LRScheduler.__init__ (which wraps optimizer.step) did not run
    # attributes it does not define come from the wrapped scheduler
    assert sched.optimizer is opt and sched.base_lrs == [1.0] and sched.last_epoch == 0


def test_steps_the_inner_scheduler_every_k_calls_written_out() -> None:
    opt = _opt()
    sched = GradAccumLrSchedulerByStep(StepLR(opt, step_size=1, gamma=0.5), 3)
    lrs = []
    for _ in range(7):
        opt.step()
        sched.step()
        lrs.append(sched.get_last_lr()[0])
    assert lrs == [1.0, 1.0, 0.5, 0.5, 0.5, 0.25, 0.25]


def test_usable_where_torch_expects_a_scheduler() -> None:
    opt = _opt()
    warm = LambdaLR(opt, lambda e: 0.1)
    accum = GradAccumLrSchedulerByStep(StepLR(opt, step_size=1, gamma=0.5), 2)
    # SequentialLR type-checks its schedulers and reads .optimizer from each
    seq = SequentialLR(opt, [warm, accum], milestones=[1])
    assert seq._schedulers[1] is accum


@pytest.mark.parametrize("bad", [None, 3, "StepLR"])
def test_refuses_a_non_scheduler(bad) -> None:
    with pytest.raises(TypeError, match="lr_scheduler must be"):
        GradAccumLrSchedulerByStep(bad, 2)


def test_stays_a_working_scheduler_through_the_lr_scheduler_base_api() -> None:
    opt = _opt()
    sched = GradAccumLrSchedulerByStep(StepLR(opt, step_size=1, gamma=0.5), 2)
    lrs = []
    for _ in range(4):
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs == [1.0, 0.5, 0.5, 0.25]  # the optimizer's lr itself moves, once per 2 calls
    state = sched.state_dict()
    other_opt = _opt()
    other = GradAccumLrSchedulerByStep(StepLR(other_opt, step_size=1, gamma=0.5), 2)
    other.load_state_dict(state)
    assert other.get_last_lr() == [0.25] and other.last_epoch == 2


@pytest.mark.parametrize("kind", ["optim_wrapper", "grad_accum_optimizer"])
def test_linked_to_an_accumulating_optimizer_through_its_public_window(kind: str) -> None:
    model = nn.Linear(2, 1)
    sgd = torch.optim.SGD(model.parameters(), lr=1.0)
    wrapped = OptimWrapper(sgd, 3) if kind == "optim_wrapper" else GradAccumOptimizer(sgd, 3)
    assert isinstance(wrapped, AccumulatingOptimizer)
    sched = GradAccumLrSchedulerByStep(StepLR(sgd, step_size=1, gamma=0.5), 3, optimizer=wrapped)
    lrs = []
    for _ in range(6):
        loss = model(torch.ones(1, 2)).sum()
        if kind == "optim_wrapper":
            wrapped.update_params(loss)
        else:
            wrapped.backward(loss)
            wrapped.step()
            wrapped.zero_grad()
        sched.step()
        lrs.append(sgd.param_groups[0]["lr"])
    assert wrapped.window.steps == 2
    assert lrs == [1.0, 1.0, 0.5, 0.5, 0.5, 0.25]


def test_refuses_an_optimizer_without_a_window() -> None:
    opt = _opt()
    assert not isinstance(opt, AccumulatingOptimizer)
    with pytest.raises(TypeError, match="optimizer must be a GradAccumOptimizer or OptimWrapper"):
        GradAccumLrSchedulerByStep(StepLR(opt, step_size=1), 2, optimizer=opt)
