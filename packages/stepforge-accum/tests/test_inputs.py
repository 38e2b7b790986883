# SPDX-License-Identifier: Apache-2.0
"""Bad inputs are refused where they enter, with the parameter named (clip_grad, count status, counts).

Also: what happens past ``max_counts`` (mmengine's OptimWrapper divides by the remainder there, or asserts when
there is none; ours keeps windows of ``accumulative_counts`` divided by their real length, and warns), checked
against sequences written out by hand.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import StepLR

from stepforge.accum import (
    AccumulationWarning,
    GradAccumDataloader,
    GradAccumGradientHandler,
    GradAccumLrSchedulerByStep,
    GradAccumOptimizer,
    OptimWrapper,
)
from stepforge.core import HyperParameterError
from stepforge.testing.accum_cases import tiny_mlp


def _sgd(model: nn.Module) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=0.1)


# -- clip_grad -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("clip_grad", "match"),
    [
        (dict(max_norm=0.0), r"clip_grad\['max_norm'\]=0.0.*must be in \(0, inf\)"),
        (dict(max_norm=-1.0), r"clip_grad\['max_norm'\]"),
        (dict(max_norm=float("nan")), r"clip_grad\['max_norm'\]"),
        (dict(max_norm="1.0"), r"clip_grad\['max_norm'\].*real number"),
        (dict(max_norm=True), r"clip_grad\['max_norm'\].*real number"),
        (dict(max_norm=1.0, norm_type=0), r"clip_grad\['norm_type'\]"),
        (dict(max_norm=1.0, norm_type=-2.0), r"clip_grad\['norm_type'\]"),
        (dict(type="value", clip_value=0), r"clip_grad\['clip_value'\]"),
        (dict(type="value", clip_value=-0.5), r"clip_grad\['clip_value'\]"),
        (dict(type="value", max_norm=1.0), r"unknown argument\(s\) \['max_norm'\] for type='value'"),
        (dict(type="norm", max_nrom=1.0), r"unknown argument\(s\) \['max_nrom'\]"),
        (dict(type="norm", norm_type=2.0), r"type='norm' needs max_norm"),
        (dict(type="l2", max_norm=1.0), r"clip_grad type must be 'norm' or 'value'"),
        (dict(type="norm"), r"besides 'type'"),
        (dict(max_norm=1.0, error_if_nonfinite="yes"), r"error_if_nonfinite"),
    ],
)
def test_clip_grad_refused_at_construction(clip_grad: dict, match: str) -> None:
    with pytest.raises(HyperParameterError, match=match):
        OptimWrapper(_sgd(tiny_mlp()), 2, clip_grad=clip_grad)


def test_clip_grad_accepted_forms() -> None:
    model = tiny_mlp()
    for cfg in (
        dict(max_norm=math.inf),  # measure the norm, clip nothing
        dict(max_norm=1, norm_type="inf"),
        dict(max_norm=1.0, norm_type=1.0, error_if_nonfinite=True, foreach=None),
        dict(type="value", clip_value=0.5, foreach=False),
    ):
        OptimWrapper(_sgd(model), 2, clip_grad=cfg)


def test_grad_accum_optimizer_clip_arguments_are_checked_even_inside_a_window() -> None:
    model = tiny_mlp()
    optim = GradAccumOptimizer(_sgd(model), 2, model=model)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(HyperParameterError, match="max_norm"):
            optim.clip_grad_norm(model, bad)
    with pytest.raises(HyperParameterError, match="norm_type"):
        optim.clip_grad_norm(model, 1.0, norm_type=0.0)
    with pytest.raises(HyperParameterError, match="max_norm"):
        optim.clip_grad_by_norm(0)


# -- initialize_count_status ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("init", "max_counts", "match"),
    [
        (0, 0, r"invalid max_counts=0.*>= 1 .* or -1"),
        (0, -2, r"invalid max_counts=-2"),
        (0, 10.0, r"invalid max_counts=10.0"),
        (0, "10", r"invalid max_counts='10'"),
        (0, True, r"invalid max_counts=True"),
        (-1, 10, r"invalid init_counts=-1"),
        (2.0, 10, r"invalid init_counts=2.0"),
        (None, 10, r"invalid init_counts=None"),
        (11, 10, r"init_counts=11 is past max_counts=10"),
    ],
)
def test_initialize_count_status_refuses(init, max_counts, match: str) -> None:
    model = tiny_mlp()
    wrapper = OptimWrapper(_sgd(model), 3)
    with pytest.raises(HyperParameterError, match=match):
        wrapper.initialize_count_status(model, init, max_counts)
    assert (wrapper.inner_count, wrapper.max_counts) == (0, -1)  # nothing was half-applied


def test_initialize_count_status_accepts_unknown_total_and_the_end() -> None:
    model = tiny_mlp()
    wrapper = OptimWrapper(_sgd(model), 3)
    wrapper.initialize_count_status(model, 6, -1)
    assert (wrapper.inner_count, wrapper.max_counts) == (6, -1)
    wrapper.initialize_count_status(model, 9, 9)  # resumed at the very end
    assert (wrapper.inner_count, wrapper.max_counts) == (9, 9)


@pytest.mark.parametrize("bad", [0, -3, 2.5, "4", None, True])
def test_accumulate_size_refused_by_every_colossalai_wrapper(bad) -> None:
    model = tiny_mlp()
    sched = StepLR(_sgd(model), 1)

    class _Handler:
        def handle_gradient(self) -> None:
            pass

    for build in (
        lambda: GradAccumOptimizer(_sgd(model), bad),
        lambda: GradAccumDataloader([1, 2, 3], bad),
        lambda: GradAccumLrSchedulerByStep(sched, bad),
        lambda: GradAccumGradientHandler(_Handler(), bad),
    ):
        with pytest.raises(HyperParameterError, match="accumulate_size"):
            build()


def test_wrong_objects_are_named() -> None:
    with pytest.raises(TypeError, match="lr_scheduler must be a learning-rate scheduler"):
        GradAccumLrSchedulerByStep(object(), 2)
    with pytest.raises(TypeError, match="grad_handler must have handle_gradient"):
        GradAccumGradientHandler(object(), 2)
    with pytest.raises(HyperParameterError, match="scheduler_clock"):
        OptimWrapper(_sgd(tiny_mlp()), 2, scheduler_clock="epoch")


# -- past max_counts: written-out sequences ------------------------------------------------------------------
def _sequence(counts: int, max_counts: int, n: int):
    model = tiny_mlp()
    opt = _sgd(model)
    steps = []
    original = opt.step

    def counting_step(*a, **kw):
        steps.append(wrapper.inner_count)
        return original(*a, **kw)

    opt.step = counting_step  # type: ignore[method-assign]
    wrapper = OptimWrapper(opt, counts)
    wrapper.initialize_count_status(model, 0, max_counts)
    x = torch.randn(2, 4)
    divisors = []
    for _ in range(n):
        divisors.append(round(1.0 / wrapper.scale_loss(torch.tensor(1.0)).item()))
        wrapper.update_params(model(x).pow(2).mean())
    return divisors, steps


def test_past_max_counts_divides_by_the_real_window_and_warns() -> None:
    # counts 3, max 10, 15 micro-batches. mmengine: steps 3 6 9 10 12 15, divisors 3x9, then 1 (remainder)
    # for micro-batches 10..15 (so windows 11-12 and 13-15 come out 2x and 3x too large).
    # Ours: the windows after max_counts are 11-12 (length 2) and 13-15 (length 3), each divided by its length.
    with pytest.warns(AccumulationWarning, match="past max_counts=10"):
        divisors, steps = _sequence(3, 10, 15)
    assert steps == [3, 6, 9, 10, 12, 15]
    assert divisors == [3] * 9 + [1] + [2, 2] + [3, 3, 3]


def test_past_max_counts_without_remainder() -> None:
    # counts 4, max 8: mmengine asserts on micro-batch 9 (remainder 0); ours goes on in windows of 4
    with pytest.warns(AccumulationWarning, match="past max_counts=8"):
        divisors, steps = _sequence(4, 8, 12)
    assert steps == [4, 8, 12]
    assert divisors == [4] * 12


def test_no_warning_up_to_max_counts() -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        divisors, steps = _sequence(3, 10, 10)
    assert (divisors, steps) == ([3] * 9 + [1], [3, 6, 9, 10])
