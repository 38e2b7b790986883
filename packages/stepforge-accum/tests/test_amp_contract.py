# SPDX-License-Identifier: Apache-2.0
"""ColossalAI's optimizer-wrapper contract: accumulation goes *through* an AMP/ZeRO wrapper, never around it.

``_ScalingOptimizer`` is a small ColossalAI-style ``OptimizerWrapper`` with a static loss scale of 1024:
``backward(loss)`` backpropagates ``loss * 1024``, ``step()`` unscales first, ``clip_grad_norm_`` unscales
before measuring. An accumulator that calls ``loss.backward()`` itself bypasses the scaling while ``step``
still unscales, so the update comes out 1024 times too small; one that clips with ``torch.nn.utils`` measures
a norm 1024 times too large. The reference is plain SGD on the concatenated window batch (written here).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from stepforge.accum import GradAccumOptimizer, OptimWrapper
from stepforge.testing.accum_cases import big_batch_reference, mse, tiny_mlp

SCALE = 1024.0
ATOL = 1e-6
RTOL = 1e-5


class _ScalingOptimizer:
    """ColossalAI ``OptimizerWrapper`` surface with a static loss scale (an AMP wrapper in miniature)."""

    def __init__(self, optim: torch.optim.Optimizer) -> None:
        self.optim = optim
        self.param_groups = optim.param_groups
        self.defaults = optim.defaults
        self.unscaled = False
        self.calls = {"backward": 0, "backward_by_grad": 0, "clip_grad_norm_": 0, "step": 0}

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"] if p.grad is not None]

    def backward(self, loss: torch.Tensor) -> None:
        self.calls["backward"] += 1
        (loss * SCALE).backward()

    def backward_by_grad(self, tensor: torch.Tensor, grad: torch.Tensor) -> None:
        self.calls["backward_by_grad"] += 1
        torch.autograd.backward(tensor, grad * SCALE)

    def _unscale(self) -> None:
        if not self.unscaled:
            for p in self._params():
                p.grad.div_(SCALE)
            self.unscaled = True

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        self.calls["clip_grad_norm_"] += 1
        self._unscale()
        return nn.utils.clip_grad_norm_(self._params(), max_norm, norm_type)

    def step(self, *args, **kwargs):
        self.calls["step"] += 1
        self._unscale()
        return self.optim.step(*args, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)
        self.unscaled = False

    def state_dict(self):
        return self.optim.state_dict()

    def load_state_dict(self, state):
        self.optim.load_state_dict(state)


def _windows(k: int, n_windows: int, batch: int = 3):
    g = torch.Generator().manual_seed(7)
    return [
        [(torch.randn(batch, 4, generator=g), torch.randn(batch, 1, generator=g)) for _ in range(k)]
        for _ in range(n_windows)
    ]


def _checked_big_batch(windows, lr: float, max_norm: float | None = None) -> list[torch.Tensor]:
    """One SGD step per window on its concatenated batch (equal micro-batches: mean of means = mean)."""

    def clip(params):
        norm = nn.utils.clip_grad_norm_(params, max_norm)
        assert norm > 10 * max_norm  # the clip is active, so a wrong norm would show

    return big_batch_reference(windows, lr=lr, clip=None if max_norm is None else clip)


def _assert_matches(model: nn.Module, ref: list[torch.Tensor], start: list[torch.Tensor]) -> None:
    for p, r, s in zip(model.parameters(), ref, start, strict=True):
        # the update itself must match (a 1024x too small update would leave p close to its start)
        torch.testing.assert_close(p.detach() - s, r - s, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("by_grad", [False, True])
@pytest.mark.parametrize("clip", [False, True])
def test_grad_accum_optimizer_backward_and_clip_go_through_the_wrapper(by_grad: bool, clip: bool) -> None:
    k, lr, max_norm = 3, 0.5, 0.01
    windows = _windows(k, 2)
    ref = _checked_big_batch(windows, lr, max_norm if clip else None)
    model = tiny_mlp()
    start = [p.detach().clone() for p in model.parameters()]
    inner = _ScalingOptimizer(torch.optim.SGD(model.parameters(), lr=lr))
    optim = GradAccumOptimizer(inner, accumulate_size=k, model=model)
    for window in windows:
        for x, y in window:
            optim.zero_grad()
            loss = mse(model, x, y)
            if by_grad:  # ColossalAI: the output gradient already carries the 1/k factor
                optim.backward_by_grad(loss, torch.tensor(1.0 / k))
            else:
                optim.backward(loss)
            if clip:
                optim.clip_grad_norm(model, max_norm)
            optim.step()
    _assert_matches(model, ref, start)
    used = "backward_by_grad" if by_grad else "backward"
    assert inner.calls[used] == 2 * k and inner.calls["step"] == 2
    assert inner.calls["clip_grad_norm_"] == (2 if clip else 0)  # only at the window's end


def test_grad_accum_optimizer_clip_grad_by_norm_spelling() -> None:
    k, lr, max_norm = 2, 0.5, 0.01
    windows = _windows(k, 1)
    ref = _checked_big_batch(windows, lr, max_norm)
    model = tiny_mlp()
    start = [p.detach().clone() for p in model.parameters()]
    inner = _ScalingOptimizer(torch.optim.SGD(model.parameters(), lr=lr))
    optim = GradAccumOptimizer(inner, accumulate_size=k, model=model)
    for x, y in windows[0]:
        optim.backward(mse(model, x, y))
        norm = optim.clip_grad_by_norm(max_norm)
    assert norm is not None and norm.item() > 10 * max_norm  # the unscaled norm (not 1024x it)
    optim.step()
    _assert_matches(model, ref, start)


@pytest.mark.parametrize("clip", [False, True])
def test_optim_wrapper_backward_and_clip_go_through_the_wrapper(clip: bool) -> None:
    k, lr, max_norm = 3, 0.5, 0.01
    windows = _windows(k, 2)
    ref = _checked_big_batch(windows, lr, max_norm if clip else None)
    model = tiny_mlp()
    start = [p.detach().clone() for p in model.parameters()]
    inner = _ScalingOptimizer(torch.optim.SGD(model.parameters(), lr=lr))
    wrapper = OptimWrapper(inner, k, clip_grad=dict(max_norm=max_norm) if clip else None)
    for window in windows:
        for x, y in window:
            with wrapper.optim_context(model):
                loss = mse(model, x, y)
            wrapper.update_params(loss)
    _assert_matches(model, ref, start)
    assert inner.calls["backward"] == 2 * k and inner.calls["step"] == 2
    assert inner.calls["clip_grad_norm_"] == (2 if clip else 0)
    if clip:
        assert wrapper.grad_norm is not None and 10 * max_norm < wrapper.grad_norm.item() < 100.0


def test_plain_optimizer_still_uses_tensor_backward_and_torch_clipping() -> None:
    k, lr, max_norm = 2, 0.5, 0.01
    windows = _windows(k, 1)
    ref = _checked_big_batch(windows, lr, max_norm)
    model = tiny_mlp()
    start = [p.detach().clone() for p in model.parameters()]
    optim = GradAccumOptimizer(torch.optim.SGD(model.parameters(), lr=lr), accumulate_size=k, model=model)
    for x, y in windows[0]:
        optim.backward(mse(model, x, y))
        optim.clip_grad_norm(model, max_norm)
        optim.step()
    _assert_matches(model, ref, start)
