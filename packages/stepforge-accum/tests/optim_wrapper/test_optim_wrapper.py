# SPDX-License-Identifier: Apache-2.0
"""OptimWrapper (mmengine API): step/divisor sequences, exactness, weighted mode, clipping, optimizer surface.

State and misuse: ``test_state.py``; the extension hooks: ``test_hooks.py`` (both beside this file).

The references are written out by hand (mmengine's documented sequences) or computed with plain torch on the
whole batch; nothing is derived from the code under test.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from stepforge.accum import AccumulationWarning, OptimWrapper
from stepforge.core import OPTIM_WRAPPERS
from stepforge.testing.accum_cases import (
    assert_params_close,
    big_batch_reference,
    mse,
    param_copies,
    regression_data,
    split_batches,
    tiny_mlp,
)


class _Recorder(torch.optim.SGD):
    """SGD that records after which backward it stepped (the wrapper's counter is read from outside)."""

    def __init__(self, params, **kw):
        super().__init__(params, **kw)
        self.calls = 0

    def step(self, closure=None):
        self.calls += 1
        return super().step(closure)


# -- mmengine differential: explicit sequences ---------------------------------------------------------------
def _run_sequence(counts: int, n: int, init: int | None = None, max_counts: int | None = None):
    model = tiny_mlp()
    opt = _Recorder(model.parameters(), lr=0.1)
    wrapper = OptimWrapper(opt, accumulative_counts=counts)
    if init is not None:
        wrapper.initialize_count_status(model, init, max_counts)
    x, y = regression_data(2 * n)
    divisors, syncs, steps_after = [], [], []
    start = wrapper.inner_count
    for i in range(n):
        syncs.append(wrapper.should_sync())
        divisors.append(round(1.0 / wrapper.scale_loss(torch.tensor(1.0)).item()))
        before = opt.calls
        wrapper.update_params(mse(model, x[2 * i : 2 * i + 2], y[2 * i : 2 * i + 2]))
        if opt.calls > before:
            steps_after.append(start + i + 1)
    return divisors, syncs, steps_after


def test_mmengine_sequence_counts3_max10() -> None:
    divisors, syncs, steps = _run_sequence(3, 10, init=0, max_counts=10)
    assert steps == [3, 6, 9, 10]
    assert divisors == [3, 3, 3, 3, 3, 3, 3, 3, 3, 1]
    # should_sync is true on the micro-steps whose pre-count is 2, 5, 8 and 9
    assert [i for i, s in enumerate(syncs) if s] == [2, 5, 8, 9]


def test_mmengine_sequence_without_initialize_never_steps_the_tail() -> None:
    divisors, _, steps = _run_sequence(3, 10)
    assert steps == [3, 6, 9]
    assert divisors == [3] * 10


def test_mmengine_sequence_counts1_and_max_below_counts() -> None:
    divisors, syncs, steps = _run_sequence(1, 4)
    assert (divisors, syncs, steps) == ([1, 1, 1, 1], [True] * 4, [1, 2, 3, 4])
    divisors, _, steps = _run_sequence(4, 3, init=0, max_counts=3)
    assert (divisors, steps) == ([3, 3, 3], [3])
    divisors, _, steps = _run_sequence(4, 8, init=0, max_counts=8)  # remainder 0
    assert (divisors, steps) == ([4] * 8, [4, 8])


def test_mmengine_sequence_resume_mid_window_warns() -> None:
    with pytest.warns(AccumulationWarning, match="init_counts=4 is not a multiple"):
        divisors, syncs, steps = _run_sequence(3, 6, init=4, max_counts=10)
    # counts after the backward: 5..10; windows stay aligned to multiples of 3
    assert steps == [6, 9, 10]
    assert divisors == [3, 3, 3, 3, 3, 1]
    assert [4 + i for i, s in enumerate(syncs) if s] == [5, 8, 9]


def test_parameters_match_mmengine_semantics() -> None:
    """Our wrapper vs a hand-written loop with the documented factors and step points (momentum SGD)."""
    counts, max_counts = 3, 10
    factors = [3, 3, 3, 3, 3, 3, 3, 3, 3, 1]
    step_after = {3, 6, 9, 10}
    x, y = regression_data(20)
    ref = tiny_mlp()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for i in range(max_counts):
        (mse(ref, x[2 * i : 2 * i + 2], y[2 * i : 2 * i + 2]) / factors[i]).backward()
        if i + 1 in step_after:
            ref_opt.step()
            ref_opt.zero_grad()
    model = tiny_mlp()
    wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), counts)
    wrapper.initialize_count_status(model, 0, max_counts)
    for i in range(max_counts):
        with wrapper.optim_context(model):
            loss = mse(model, x[2 * i : 2 * i + 2], y[2 * i : 2 * i + 2])
        wrapper.update_params(loss)
    assert_params_close(param_copies(model), param_copies(ref))


# -- exactness ---------------------------------------------------------------------------------------------
def test_uniform_micro_batches_equal_one_big_batch() -> None:
    k, b = 4, 3
    x, y = regression_data(3 * k * b)
    windows = []
    for w in range(3):
        chunks = split_batches(x[w * k * b : (w + 1) * k * b], y[w * k * b : (w + 1) * k * b], [b] * k)
        windows.append(chunks)
    ref = big_batch_reference(windows, optim=torch.optim.Adam, lr=1e-2)
    for weighted in (False, True):
        model = tiny_mlp()
        wrapper = OptimWrapper(torch.optim.Adam(model.parameters(), lr=1e-2), accumulative_counts=k)
        for window in windows:
            for xm, ym in window:
                loss = mse(model, xm, ym)
                wrapper.update_params(loss, num_items=len(xm) if weighted else None)
        assert_params_close(param_copies(model), ref)


def test_non_uniform_micro_batches_weighted_is_exact_unweighted_is_not() -> None:
    sizes = [[3, 1, 5], [2, 6, 1]]
    x, y = regression_data(18)
    windows, i = [], 0
    for ws in sizes:
        chunks = split_batches(x[i : i + sum(ws)], y[i : i + sum(ws)], ws)
        i += sum(ws)
        windows.append(chunks)
    ref = big_batch_reference(windows)
    results = {}
    for mode in ("weighted", "tensor-weight", "plain"):
        model = tiny_mlp()
        wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), accumulative_counts=3)
        for window in windows:
            for xm, ym in window:
                loss = mse(model, xm, ym)
                if mode == "weighted":
                    wrapper.update_params(loss, num_items=len(xm))
                elif mode == "tensor-weight":
                    wrapper.update_params(loss, num_items=torch.tensor(len(xm)))
                else:
                    wrapper.update_params(loss)
        results[mode] = param_copies(model)
    assert_params_close(results["weighted"], ref)
    assert_params_close(results["tensor-weight"], ref)
    # the mean of per-micro-batch means is a different gradient (the 2024 GA normalisation bug)
    assert max((a - b).abs().max().item() for a, b in zip(results["plain"], ref, strict=True)) > 1e-4


def test_partial_last_window_weighted_and_plain() -> None:
    # 7 micro-batches of 2 samples, counts 3, max 7: windows [3, 3, 1]
    x, y = regression_data(14)
    chunks = split_batches(x, y, [2] * 7)
    windows = [chunks[a:b] for a, b in ((0, 3), (3, 6), (6, 7))]
    ref = big_batch_reference(windows)
    for weighted in (False, True):
        model = tiny_mlp()
        wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), accumulative_counts=3)
        wrapper.initialize_count_status(model, 0, 7)
        for xm, ym in chunks:
            wrapper.update_params(mse(model, xm, ym), num_items=2 if weighted else None)
        assert wrapper.should_update()
        assert_params_close(param_copies(model), ref)


@pytest.mark.parametrize("kind", ["norm", "value"])
def test_clip_grad_matches_clipping_the_full_batch_gradient(kind: str) -> None:
    x, y = regression_data(12)
    chunks = split_batches(x, y, [4, 4, 4])
    windows = [chunks]
    if kind == "norm":
        cfg = {"type": "norm", "max_norm": 0.05}
        clip = lambda ps: nn.utils.clip_grad_norm_(list(ps), max_norm=0.05)  # noqa: E731
    else:
        cfg = {"type": "value", "clip_value": 0.01}
        clip = lambda ps: nn.utils.clip_grad_value_(list(ps), clip_value=0.01)  # noqa: E731
    ref = big_batch_reference(windows, clip=clip)
    original = copy.deepcopy(cfg)
    model = tiny_mlp()
    wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), 3, clip_grad=cfg)
    assert cfg == original  # the caller's dict is not mutated (mmengine pops 'type')
    for xm, ym in chunks:
        wrapper.update_params(mse(model, xm, ym), num_items=4)  # clip after the weighted normalisation
    assert_params_close(param_copies(model), ref)
    if kind == "norm":
        assert wrapper.grad_norm is not None and wrapper.grad_norm.item() > 0.05


def test_default_clip_type_is_norm_and_errors() -> None:
    model = tiny_mlp()
    wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), clip_grad={"max_norm": 1.0})
    assert wrapper.clip_type == "norm"
    with pytest.raises(ValueError, match="'norm' or 'value'"):
        OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), clip_grad={"type": "l1", "max_norm": 1})
    with pytest.raises(ValueError, match="besides 'type'"):
        OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), clip_grad={"type": "norm"})
    with pytest.raises(TypeError, match="clip_grad must be a dict"):
        OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), clip_grad=1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be a torch.optim.Optimizer"):
        OptimWrapper(object())  # type: ignore[arg-type]


# -- optimizer surface ---------------------------------------------------------------------------------------
def test_param_groups_base_settings_lr_momentum_and_registry() -> None:
    model = tiny_mlp()
    opt = torch.optim.SGD(
        [{"params": model[0].parameters(), "lr": 0.5}, {"params": model[2].parameters()}],
        lr=0.1,
        momentum=0.9,
    )
    wrapper = OptimWrapper(opt, accumulative_counts=2)
    assert len(wrapper.param_groups) == 3
    base = wrapper.param_groups[-1]
    assert base["lr"] == 0.1 and base["momentum"] == 0.9 and torch.equal(base["params"], torch.tensor([0.0]))
    assert wrapper.get_lr() == {"base_lr": [0.1], "lr": [0.5, 0.1]}
    assert wrapper.get_momentum() == {"momentum": [0.9, 0.9]}
    single = OptimWrapper(torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.8, 0.99)))
    assert single.base_param_settings is None and len(single.param_groups) == 1
    assert single.get_lr() == {"lr": [1e-3]}
    assert single.get_momentum() == {"momentum": [0.8]}
    assert OptimWrapper(torch.optim.Adagrad(model.parameters())).get_momentum() == {"momentum": [0]}
    sd = wrapper.state_dict()
    assert "base_param_settings" in sd and "accumulation" in sd
    assert OPTIM_WRAPPERS.get("OptimWrapper") is OptimWrapper
