# SPDX-License-Identifier: Apache-2.0
"""OptimWrapper (mmengine API): step/divisor sequences, exactness, weighted mode, clipping, state, misuse.

The references are written out by hand (mmengine's documented sequences) or computed with plain torch on the
whole batch; nothing is derived from the code under test.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from stepforge.accum import AccumulationError, AccumulationWarning, OptimWrapper
from stepforge.core import OPTIM_WRAPPERS, HyperParameterError

ATOL = 1e-6
RTOL = 1e-5


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _data(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)


def _mse(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x) - y).pow(2).mean()


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _assert_close(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, atol=ATOL, rtol=RTOL)


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
    model = _model()
    opt = _Recorder(model.parameters(), lr=0.1)
    wrapper = OptimWrapper(opt, accumulative_counts=counts)
    if init is not None:
        wrapper.initialize_count_status(model, init, max_counts)
    x, y = _data(2 * n)
    divisors, syncs, steps_after = [], [], []
    start = wrapper.inner_count
    for i in range(n):
        syncs.append(wrapper.should_sync())
        divisors.append(round(1.0 / wrapper.scale_loss(torch.tensor(1.0)).item()))
        before = opt.calls
        wrapper.update_params(_mse(model, x[2 * i : 2 * i + 2], y[2 * i : 2 * i + 2]))
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
    x, y = _data(20)
    ref = _model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for i in range(max_counts):
        (_mse(ref, x[2 * i : 2 * i + 2], y[2 * i : 2 * i + 2]) / factors[i]).backward()
        if i + 1 in step_after:
            ref_opt.step()
            ref_opt.zero_grad()
    model = _model()
    wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), counts)
    wrapper.initialize_count_status(model, 0, max_counts)
    for i in range(max_counts):
        with wrapper.optim_context(model):
            loss = _mse(model, x[2 * i : 2 * i + 2], y[2 * i : 2 * i + 2])
        wrapper.update_params(loss)
    _assert_close(_params(model), _params(ref))


# -- exactness ---------------------------------------------------------------------------------------------
def _full_batch_reference(windows, lr=0.1, clip=None, optim=torch.optim.SGD, **kw):
    model = _model()
    opt = optim(model.parameters(), lr=lr, **kw)
    for xs, ys in windows:
        opt.zero_grad()
        _mse(model, torch.cat(xs), torch.cat(ys)).backward()
        if clip is not None:
            clip(model.parameters())
        opt.step()
    return _params(model)


def _split(x, y, sizes):
    out, i = [], 0
    for s in sizes:
        out.append((x[i : i + s], y[i : i + s]))
        i += s
    return out


def test_uniform_micro_batches_equal_one_big_batch() -> None:
    k, b = 4, 3
    x, y = _data(3 * k * b)
    windows = []
    for w in range(3):
        chunks = _split(x[w * k * b : (w + 1) * k * b], y[w * k * b : (w + 1) * k * b], [b] * k)
        windows.append(([c[0] for c in chunks], [c[1] for c in chunks]))
    ref = _full_batch_reference(windows, optim=torch.optim.Adam, lr=1e-2)
    for weighted in (False, True):
        model = _model()
        wrapper = OptimWrapper(torch.optim.Adam(model.parameters(), lr=1e-2), accumulative_counts=k)
        for xs, ys in windows:
            for xm, ym in zip(xs, ys, strict=True):
                loss = _mse(model, xm, ym)
                wrapper.update_params(loss, num_items=len(xm) if weighted else None)
        _assert_close(_params(model), ref)


def test_non_uniform_micro_batches_weighted_is_exact_unweighted_is_not() -> None:
    sizes = [[3, 1, 5], [2, 6, 1]]
    x, y = _data(18)
    windows, i = [], 0
    for ws in sizes:
        chunks = _split(x[i : i + sum(ws)], y[i : i + sum(ws)], ws)
        i += sum(ws)
        windows.append(([c[0] for c in chunks], [c[1] for c in chunks]))
    ref = _full_batch_reference(windows)
    results = {}
    for mode in ("weighted", "tensor-weight", "plain"):
        model = _model()
        wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), accumulative_counts=3)
        for xs, ys in windows:
            for xm, ym in zip(xs, ys, strict=True):
                loss = _mse(model, xm, ym)
                if mode == "weighted":
                    wrapper.update_params(loss, num_items=len(xm))
                elif mode == "tensor-weight":
                    wrapper.update_params(loss, num_items=torch.tensor(len(xm)))
                else:
                    wrapper.update_params(loss)
        results[mode] = _params(model)
    _assert_close(results["weighted"], ref)
    _assert_close(results["tensor-weight"], ref)
    # the mean of per-micro-batch means is a different gradient (the 2024 GA normalisation bug)
    assert max((a - b).abs().max().item() for a, b in zip(results["plain"], ref, strict=True)) > 1e-4


def test_partial_last_window_weighted_and_plain() -> None:
    # 7 micro-batches of 2 samples, counts 3, max 7: windows [3, 3, 1]
    x, y = _data(14)
    chunks = _split(x, y, [2] * 7)
    windows = [
        ([c[0] for c in chunks[a:b]], [c[1] for c in chunks[a:b]]) for a, b in ((0, 3), (3, 6), (6, 7))
    ]
    ref = _full_batch_reference(windows)
    for weighted in (False, True):
        model = _model()
        wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), accumulative_counts=3)
        wrapper.initialize_count_status(model, 0, 7)
        for xm, ym in chunks:
            wrapper.update_params(_mse(model, xm, ym), num_items=2 if weighted else None)
        assert wrapper.should_update()
        _assert_close(_params(model), ref)


@pytest.mark.parametrize("kind", ["norm", "value"])
def test_clip_grad_matches_clipping_the_full_batch_gradient(kind: str) -> None:
    x, y = _data(12)
    chunks = _split(x, y, [4, 4, 4])
    windows = [([c[0] for c in chunks], [c[1] for c in chunks])]
    if kind == "norm":
        cfg = {"type": "norm", "max_norm": 0.05}
        clip = lambda ps: nn.utils.clip_grad_norm_(list(ps), max_norm=0.05)  # noqa: E731
    else:
        cfg = {"type": "value", "clip_value": 0.01}
        clip = lambda ps: nn.utils.clip_grad_value_(list(ps), clip_value=0.01)  # noqa: E731
    ref = _full_batch_reference(windows, clip=clip)
    original = copy.deepcopy(cfg)
    model = _model()
    wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), 3, clip_grad=cfg)
    assert cfg == original  # the caller's dict is not mutated (mmengine pops 'type')
    for xm, ym in chunks:
        wrapper.update_params(_mse(model, xm, ym), num_items=4)  # clip after the weighted normalisation
    _assert_close(_params(model), ref)
    if kind == "norm":
        assert wrapper.grad_norm is not None and wrapper.grad_norm.item() > 0.05


def test_default_clip_type_is_norm_and_errors() -> None:
    model = _model()
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
    model = _model()
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


def test_state_dict_round_trip_keeps_counters_and_resumes_exactly() -> None:
    x, y = _data(40)
    chunks = _split(x, y, [2] * 20)

    def run(model, wrapper, part):
        for xm, ym in part:
            wrapper.update_params(_mse(model, xm, ym), num_items=len(xm))

    model = _model()
    wrapper = OptimWrapper(torch.optim.Adam(model.parameters(), lr=1e-2), 3)
    wrapper.initialize_count_status(model, 0, 20)
    run(model, wrapper, chunks)
    straight = _params(model)

    model = _model()
    wrapper = OptimWrapper(torch.optim.Adam(model.parameters(), lr=1e-2), 3)
    wrapper.initialize_count_status(model, 0, 20)
    run(model, wrapper, chunks[:9])  # stop right after a step (9 = 3 windows)
    state = copy.deepcopy(wrapper.state_dict())
    saved_model = copy.deepcopy(model.state_dict())
    assert state["accumulation"]["inner_count"] == 9 and state["accumulation"]["max_counts"] == 20
    model2 = _model(seed=5)
    model2.load_state_dict(saved_model)
    wrapper2 = OptimWrapper(torch.optim.Adam(model2.parameters(), lr=1e-2), 3)
    wrapper2.load_state_dict(state)
    assert "accumulation" in state  # the caller's dict is not popped
    assert wrapper2.inner_count == 9 and wrapper2.max_counts == 20
    run(model2, wrapper2, chunks[9:])
    _assert_close(_params(model2), straight)
    # an mmengine state dict (no counters) loads too
    plain = wrapper2.optimizer.state_dict()
    OptimWrapper(torch.optim.Adam(_model().parameters(), lr=1e-2), 3).load_state_dict(plain)


def test_resume_in_the_middle_of_a_window_warns() -> None:
    model = _model()
    wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), 3)
    x, y = _data(4)
    wrapper.update_params(_mse(model, x, y), num_items=4)
    state = wrapper.state_dict()
    assert state["accumulation"]["position"] == 1 and state["accumulation"]["window_weight"] == 4.0
    other = OptimWrapper(torch.optim.SGD(_model().parameters(), lr=0.1), 3)
    with pytest.warns(AccumulationWarning, match="resuming in the middle of an accumulation window"):
        other.load_state_dict(state)
    assert other.inner_count == 1


# -- misuse --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_accumulative_counts_must_be_positive_int(bad) -> None:
    with pytest.raises(HyperParameterError, match="accumulative_counts"):
        OptimWrapper(torch.optim.SGD(_model().parameters(), lr=0.1), accumulative_counts=bad)


def test_weight_errors_and_mixing_in_a_window() -> None:
    model = _model()
    wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), 3)
    x, y = _data(4)
    for bad, msg in ((-1, "finite and >= 0"), (float("nan"), "finite"), ("3", "number"),
                     (torch.ones(2), "scalar")):  # fmt: skip
        with pytest.raises(HyperParameterError, match=msg):
            wrapper.update_params(_mse(model, x, y), num_items=bad)
    assert wrapper.inner_count == 0  # rejected before the backward
    wrapper.update_params(_mse(model, x, y), num_items=4)
    with pytest.raises(AccumulationError, match="on every micro-batch of a window or on none"):
        wrapper.update_params(_mse(model, x, y))
    wrapper2 = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), 2)
    wrapper2.update_params(_mse(model, x, y))
    with pytest.raises(AccumulationError, match="started without weights"):
        wrapper2.update_params(_mse(model, x, y), num_items=4)
    # across windows the mode may change
    wrapper3 = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), 1)
    wrapper3.update_params(_mse(model, x, y))
    wrapper3.update_params(_mse(model, x, y), num_items=4)


def test_zero_weight_window_warns_and_gives_zero_gradient() -> None:
    model = _model()
    before = _params(model)
    wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), 2)
    x, y = _data(4)
    with pytest.warns(AccumulationWarning, match="sum to 0"):
        wrapper.update_params(_mse(model, x, y), num_items=0)
        wrapper.update_params(_mse(model, x, y), num_items=0)
    _assert_close(_params(model), before)


def test_initialize_count_status_errors() -> None:
    model = _model()
    wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), 3)
    with pytest.raises(HyperParameterError, match="init_counts"):
        wrapper.initialize_count_status(model, -1, 10)
    with pytest.raises(HyperParameterError, match="max_counts"):
        wrapper.initialize_count_status(model, 0, -5)
    x, y = _data(4)
    wrapper.update_params(_mse(model, x, y))
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
    model = _model()
    x, y = _data(4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    wrapper = OptimWrapper(opt, 3, scheduler_clock="window")
    with pytest.warns(AccumulationWarning, match="scheduler is stepped per micro-batch"):
        for _ in range(3):
            wrapper.update_params(_mse(model, x, y))
            sched.step()
    # stepped once per window: silent
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    wrapper = OptimWrapper(opt, 3, scheduler_clock="window")
    with warnings.catch_warnings():
        warnings.simplefilter("error", AccumulationWarning)
        for _ in range(9):
            wrapper.update_params(_mse(model, x, y))
            if wrapper.inner_count % 3 == 0:
                sched.step()
    # mmengine's clock (default) steps schedulers per micro-batch on purpose: silent
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    wrapper = OptimWrapper(opt, 3)
    for _ in range(3):
        wrapper.update_params(_mse(model, x, y))
        sched.step()
    with pytest.raises(HyperParameterError, match="scheduler_clock"):
        OptimWrapper(opt, 3, scheduler_clock="epoch")


def test_optim_context_on_plain_model_and_repr() -> None:
    model = _model()
    wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), 2)
    x, y = _data(4)
    with wrapper.optim_context(model):
        loss = _mse(model, x, y)
    wrapper.update_params(loss)
    assert "accumulative_counts=2" in repr(wrapper) and "inner_count=1" in repr(wrapper)
