# SPDX-License-Identifier: Apache-2.0
"""OptimWrapper's public seams: the extension hooks, the read-only window and what subclasses read.

The README's "Extending OptimWrapper" example is built here and checked against plain accumulation.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from torch import nn

from stepforge.accum import AccumulationWarning, AccumulationWindow, OptimWrapper, scale_gradients


class StaticScaleOptimWrapper(OptimWrapper):
    """The README example: loss scaling by a constant, unscaled before clipping and stepping."""

    def __init__(self, optimizer, scale=1024.0, **kw):
        super().__init__(optimizer, **kw)
        self.scale, self.unscaled = scale, True
        self.events: list[str] = []

    def run_backward(self, loss, **kw):
        self.events.append("backward")
        (loss * self.scale).backward(**kw)
        self.unscaled = False

    def before_clip(self):
        self.events.append("before_clip")
        self.unscale()

    def clip_gradients(self):
        self.events.append("clip")
        return super().clip_gradients()

    def optimizer_step(self, **kw):
        self.events.append("step")
        self.unscale()  # before_clip runs only with clip_grad
        return super().optimizer_step(**kw)

    def unscale(self):
        if not self.unscaled:
            scale_gradients(self.optimizer, 1 / self.scale)
            self.unscaled = True


def _linear(seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(3, 1)


def _train_weighted(cls, clip_grad, sizes=(1, 2, 3, 2, 1, 4), counts=3):
    x = torch.randn(sum(sizes), 3, generator=torch.Generator().manual_seed(5))
    model = _linear()
    wrapper = cls(
        torch.optim.SGD(model.parameters(), lr=0.1), accumulative_counts=counts, clip_grad=clip_grad
    )
    start = 0
    for n in sizes:
        loss = model(x[start : start + n]).pow(2).mean()
        start += n
        wrapper.update_params(loss, num_items=n)
    return wrapper, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("clip_grad", [None, {"max_norm": 0.05}, {"type": "value", "clip_value": 0.01}])
def test_a_subclass_through_the_hooks_keeps_counting_weighting_and_clipping(clip_grad) -> None:
    plain, expected = _train_weighted(OptimWrapper, clip_grad)
    scaled, got = _train_weighted(StaticScaleOptimWrapper, clip_grad)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    start = [p.detach() for p in _linear().parameters()]
    assert any((a - s).abs().max() > 1e-3 for a, s in zip(got, start, strict=True))  # it trained
    assert scaled.inner_count == plain.inner_count == 6 and scaled.window.steps == 2
    window = ["backward"] * 3 + (["before_clip", "clip"] if clip_grad else []) + ["step"]
    assert scaled.events == window * 2
    if clip_grad and "max_norm" in clip_grad:  # clip_gradients' norm reaches grad_norm, unscaled
        assert scaled.grad_norm is not None
        torch.testing.assert_close(scaled.grad_norm, plain.grad_norm)
        assert float(scaled.grad_norm) > 0.05  # the clip was active
    else:
        assert scaled.grad_norm is None


def test_run_backward_gets_the_divided_or_weighted_loss_and_step_returns_optimizer_step() -> None:
    seen: list[float] = []

    class Recording(OptimWrapper):
        def run_backward(self, loss, **kw):
            seen.append(loss.item())
            super().run_backward(loss, **kw)

        def optimizer_step(self, **kw):
            super().optimizer_step(**kw)
            return ("stepped", kw)

    model = _linear()
    loss = model(torch.ones(2, 3)).sum()
    plain = Recording(torch.optim.SGD(model.parameters(), lr=0.1), accumulative_counts=4)
    plain.backward(plain.scale_loss(loss), retain_graph=True)  # divided by the window length
    weighted = Recording(torch.optim.SGD(model.parameters(), lr=0.1), accumulative_counts=4)
    weighted.backward(loss, weight=3.0, retain_graph=True)
    assert seen == pytest.approx([loss.item() / 4, loss.item() * 3.0])
    assert plain.step(closure=None) == ("stepped", {"closure": None})
    assert plain.window.steps == 1 and plain.window.position == 0


class _SuspendRecorder(OptimWrapper):
    """Counts where no_sync_context was asked for and where its context was open."""

    def __init__(self, *args, give: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.give = give
        self.asked: list[int] = []
        self.suspended = False

    def no_sync_context(self, model):
        self.asked.append(self.inner_count + 1)
        if not self.give:
            return None
        return self._suspend()

    @contextlib.contextmanager
    def _suspend(self):
        self.suspended = True
        try:
            yield
        finally:
            self.suspended = False


def test_no_sync_context_is_asked_only_for_non_final_micro_batches_and_wraps_them() -> None:
    model = _linear()
    wrapper = _SuspendRecorder(torch.optim.SGD(model.parameters(), lr=0.1), accumulative_counts=3)
    wrapper.initialize_count_status(model, 0, 7)
    inside = []
    for _ in range(7):
        with wrapper.optim_context(model):
            inside.append(wrapper.suspended)
            assert wrapper.window.context_depth == 1
            with wrapper.optim_context(model):  # nested: no second request, still suspended
                assert wrapper.window.context_depth == 2
                inside[-1] = inside[-1] and wrapper.suspended
            loss = model(torch.ones(1, 3)).sum()
        wrapper.update_params(loss)
        assert not wrapper.suspended and wrapper.window.context_depth == 0
    assert wrapper.asked == [1, 2, 4, 5]  # 3, 6 end full windows, 7 the partial last one
    assert inside == [True, True, False, True, True, False, False]
    assert wrapper.context_model is model


def test_no_sync_context_returning_none_runs_the_body_plainly() -> None:
    model = _linear()
    wrapper = _SuspendRecorder(torch.optim.SGD(model.parameters(), lr=0.1), accumulative_counts=2, give=False)
    ran = []
    for _ in range(2):
        with wrapper.optim_context(model):
            ran.append(wrapper.suspended)
            loss = model(torch.ones(1, 3)).sum()
        wrapper.update_params(loss)
    assert ran == [False, False] and wrapper.asked == [1] and wrapper.window.steps == 1


def test_window_is_public_read_only_and_round_trips_through_state_dict() -> None:
    model = _linear()
    wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), accumulative_counts=3)
    assert isinstance(wrapper.window, AccumulationWindow)
    with pytest.raises(AttributeError):
        wrapper.window = AccumulationWindow(2, owner="x")  # type: ignore[misc]
    with pytest.raises(AttributeError):
        wrapper.window.context_depth = 1  # type: ignore[misc]
    for n in (2, 5):
        wrapper.update_params(model(torch.ones(1, 3)).sum(), num_items=n)
    window = wrapper.window
    assert (window.counts, window.inner_count, window.position, window.steps) == (3, 2, 2, 0)
    assert window.weighted is True and not window.should_update() and window.should_sync()
    state = wrapper.state_dict()
    assert state["accumulation"] == window.state_dict() and state["accumulation"]["window_weight"] == 7.0

    other = OptimWrapper(torch.optim.SGD(_linear().parameters(), lr=0.1), accumulative_counts=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", AccumulationWarning)
        other.load_state_dict(state)
    assert any("middle of an accumulation window" in str(w.message) for w in caught)
    assert other.window.state_dict() == window.state_dict()
    assert (other.window.position, other.window.inner_count, other.window.weighted) == (2, 2, True)


def test_clip_type_and_context_model() -> None:
    params = list(_linear().parameters())
    assert OptimWrapper(torch.optim.SGD(params, lr=0.1)).clip_type is None
    assert OptimWrapper(torch.optim.SGD(params, lr=0.1), clip_grad={"max_norm": 1.0}).clip_type == "norm"
    value = OptimWrapper(torch.optim.SGD(params, lr=0.1), clip_grad={"type": "value", "clip_value": 1.0})
    assert value.clip_type == "value" and value.clip_grad_kwargs == {"clip_value": 1.0}
    assert value.context_model is None
    with pytest.raises(AttributeError):
        value.clip_type = "norm"  # type: ignore[misc]


def test_clip_hooks_run_only_with_clip_grad() -> None:
    calls: list[str] = []

    class Hooks(OptimWrapper):
        def before_clip(self):
            calls.append("before_clip")

        def clip_gradients(self):
            calls.append("clip")
            return torch.tensor(42.0)

    model = _linear()
    plain = Hooks(torch.optim.SGD(model.parameters(), lr=0.1))
    plain.update_params(model(torch.ones(1, 3)).sum())
    assert calls == [] and plain.grad_norm is None
    clipped = Hooks(torch.optim.SGD(model.parameters(), lr=0.1), clip_grad={"max_norm": 1.0})
    clipped.update_params(model(torch.ones(1, 3)).sum())
    assert calls == ["before_clip", "clip"] and float(clipped.grad_norm) == 42.0
