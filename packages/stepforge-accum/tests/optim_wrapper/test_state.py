# SPDX-License-Identifier: Apache-2.0
"""OptimWrapper (mmengine API): counters in state_dict and exact resume, and the misuse it reports.

The references are written out by hand or computed with plain torch on the whole batch; nothing is derived from
the code under test.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from stepforge.accum import AccumulationError, AccumulationWarning, OptimWrapper
from stepforge.core import HyperParameterError
from stepforge.testing.accum_cases import (
    assert_params_close,
    mse,
    param_copies,
    regression_data,
    split_batches,
    tiny_mlp,
)


# -- state ---------------------------------------------------------------------------------------------------
def test_state_dict_round_trip_keeps_counters_and_resumes_exactly() -> None:
    x, y = regression_data(40)
    chunks = split_batches(x, y, [2] * 20)

    def run(model, wrapper, part):
        for xm, ym in part:
            wrapper.update_params(mse(model, xm, ym), num_items=len(xm))

    model = tiny_mlp()
    wrapper = OptimWrapper(torch.optim.Adam(model.parameters(), lr=1e-2), 3)
    wrapper.initialize_count_status(model, 0, 20)
    run(model, wrapper, chunks)
    straight = param_copies(model)

    model = tiny_mlp()
    wrapper = OptimWrapper(torch.optim.Adam(model.parameters(), lr=1e-2), 3)
    wrapper.initialize_count_status(model, 0, 20)
    run(model, wrapper, chunks[:9])  # stop right after a step (9 = 3 windows)
    state = copy.deepcopy(wrapper.state_dict())
    saved_model = copy.deepcopy(model.state_dict())
    assert state["accumulation"]["inner_count"] == 9 and state["accumulation"]["max_counts"] == 20
    model2 = tiny_mlp(seed=5)
    model2.load_state_dict(saved_model)
    wrapper2 = OptimWrapper(torch.optim.Adam(model2.parameters(), lr=1e-2), 3)
    wrapper2.load_state_dict(state)
    assert "accumulation" in state  # the caller's dict is not popped
    assert wrapper2.inner_count == 9 and wrapper2.max_counts == 20
    run(model2, wrapper2, chunks[9:])
    assert_params_close(param_copies(model2), straight)
    # an mmengine state dict (no counters) loads too
    plain = wrapper2.optimizer.state_dict()
    OptimWrapper(torch.optim.Adam(tiny_mlp().parameters(), lr=1e-2), 3).load_state_dict(plain)


def test_resume_in_the_middle_of_a_window_warns() -> None:
    model = tiny_mlp()
    wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), 3)
    x, y = regression_data(4)
    wrapper.update_params(mse(model, x, y), num_items=4)
    state = wrapper.state_dict()
    assert state["accumulation"]["position"] == 1 and state["accumulation"]["window_weight"] == 4.0
    other = OptimWrapper(torch.optim.SGD(tiny_mlp().parameters(), lr=0.1), 3)
    with pytest.warns(AccumulationWarning, match="resuming in the middle of an accumulation window"):
        other.load_state_dict(state)
    assert other.inner_count == 1


# -- misuse --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_accumulative_counts_must_be_positive_int(bad) -> None:
    with pytest.raises(HyperParameterError, match="accumulative_counts"):
        OptimWrapper(torch.optim.SGD(tiny_mlp().parameters(), lr=0.1), accumulative_counts=bad)


def test_weight_errors_and_mixing_in_a_window() -> None:
    model = tiny_mlp()
    wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), 3)
    x, y = regression_data(4)
    for bad, msg in ((-1, "finite and >= 0"), (float("nan"), "finite"), ("3", "number"),
                     (torch.ones(2), "scalar")):  # fmt: skip
        with pytest.raises(HyperParameterError, match=msg):
            wrapper.update_params(mse(model, x, y), num_items=bad)
    assert wrapper.inner_count == 0  # rejected before the backward
    wrapper.update_params(mse(model, x, y), num_items=4)
    with pytest.raises(AccumulationError, match="on every micro-batch of a window or on none"):
        wrapper.update_params(mse(model, x, y))
    wrapper2 = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), 2)
    wrapper2.update_params(mse(model, x, y))
    with pytest.raises(AccumulationError, match="started without weights"):
        wrapper2.update_params(mse(model, x, y), num_items=4)
    # across windows the mode may change
    wrapper3 = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), 1)
    wrapper3.update_params(mse(model, x, y))
    wrapper3.update_params(mse(model, x, y), num_items=4)


def test_zero_weight_window_warns_and_gives_zero_gradient() -> None:
    model = tiny_mlp()
    before = param_copies(model)
    wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), 2)
    x, y = regression_data(4)
    with pytest.warns(AccumulationWarning, match="sum to 0"):
        wrapper.update_params(mse(model, x, y), num_items=0)
        wrapper.update_params(mse(model, x, y), num_items=0)
    assert_params_close(param_copies(model), before)


def test_initialize_count_status_errors() -> None:
    model = tiny_mlp()
    wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), 3)
    with pytest.raises(HyperParameterError, match="init_counts"):
        wrapper.initialize_count_status(model, -1, 10)
    with pytest.raises(HyperParameterError, match="max_counts"):
        wrapper.initialize_count_status(model, 0, -5)
    x, y = regression_data(4)
    wrapper.update_params(mse(model, x, y))
    with pytest.raises(AccumulationError, match="accumulated and not stepped"):
        wrapper.initialize_count_status(model, 0, 10)


def test_batch_norm_note_is_logged(caplog) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), 2)
    with caplog.at_level("WARNING", logger="stepforge.accum"):
        wrapper.initialize_count_status(model, 0, 10)
    assert "BatchNorm" in caplog.text


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before:UserWarning")
def test_scheduler_stepped_per_micro_batch_with_window_clock_warns() -> None:
    model = tiny_mlp()
    x, y = regression_data(4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    wrapper = OptimWrapper(opt, 3, scheduler_clock="window")
    with pytest.warns(AccumulationWarning, match="scheduler is stepped per micro-batch"):
        for _ in range(3):
            wrapper.update_params(mse(model, x, y))
            sched.step()
    # stepped once per window: silent
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    wrapper = OptimWrapper(opt, 3, scheduler_clock="window")
    with warnings.catch_warnings():
        warnings.simplefilter("error", AccumulationWarning)
        for _ in range(9):
            wrapper.update_params(mse(model, x, y))
            if wrapper.inner_count % 3 == 0:
                sched.step()
    # mmengine's clock (default) steps schedulers per micro-batch on purpose: silent
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    wrapper = OptimWrapper(opt, 3)
    for _ in range(3):
        wrapper.update_params(mse(model, x, y))
        sched.step()
    with pytest.raises(HyperParameterError, match="scheduler_clock"):
        OptimWrapper(opt, 3, scheduler_clock="epoch")


def test_optim_context_on_plain_model_and_repr() -> None:
    model = tiny_mlp()
    wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), 2)
    x, y = regression_data(4)
    with wrapper.optim_context(model):
        loss = mse(model, x, y)
    wrapper.update_params(loss)
    assert "accumulative_counts=2" in repr(wrapper) and "inner_count=1" in repr(wrapper)
