# SPDX-License-Identifier: Apache-2.0
"""Window logic against mmengine's formulas (property test), the sharded-optimizer protocol, and the
remaining warning/error paths."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from stepforge.accum import (
    AccumulationError,
    AccumulationWarning,
    GradAccumDataloader,
    GradAccumOptimizer,
    OptimWrapper,
    accumulate_gradient,
    scale_gradients,
)
from stepforge.core import ShardedOptimizer, no_sync, supports_no_sync


def _mmengine_factor(inner: int, counts: int, max_counts: int) -> int:
    """mmengine ``OptimWrapper.scale_loss`` factor, transcribed from the reference notes (§1.1)."""
    if counts == 1:
        return 1
    if max_counts == -1:
        return counts
    remainder = max_counts % counts
    return counts if inner < max_counts - remainder else remainder


def _mmengine_should_update(inner: int, counts: int, max_counts: int) -> bool:
    return inner % counts == 0 or inner == max_counts


@settings(max_examples=60, deadline=None)
@given(counts=st.integers(1, 6), max_counts=st.integers(1, 25), init=st.integers(0, 24))
def test_window_matches_mmengine_formulas(counts: int, max_counts: int, init: int) -> None:
    if init >= max_counts:
        init = 0
    model = nn.Linear(1, 1)
    wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.0), counts)
    with contextlib.ExitStack() as stack:
        if init % counts:
            stack.enter_context(pytest.warns(AccumulationWarning))
        wrapper.initialize_count_status(model, init, max_counts)
    for inner in range(init, max_counts):
        assert wrapper.should_sync() == _mmengine_should_update(inner + 1, counts, max_counts)
        factor = _mmengine_factor(inner, counts, max_counts)
        assert wrapper.scale_loss(torch.tensor(float(factor))).item() == 1.0
        wrapper.backward(model(torch.ones(1)).sum())
        assert wrapper.should_update() == _mmengine_should_update(inner + 1, counts, max_counts)
        if wrapper.should_update():
            wrapper.step()
            wrapper.zero_grad()


class _FakeSharded(torch.optim.SGD):
    """Stands in for a stepforge-zero optimizer: no_sync(), scale_grads_() and clip_grad_norm_()."""

    def __init__(self, params, **kw):
        super().__init__(params, **kw)
        self.log: list = []
        self.syncing = True

    @contextlib.contextmanager
    def no_sync(self):
        self.log.append("no_sync")
        self.syncing = False
        try:
            yield
        finally:
            self.syncing = True

    def scale_grads_(self, factor: float) -> None:
        self.log.append(("scale", factor))
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(factor)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        self.log.append(("clip", max_norm, norm_type))
        params = [p for g in self.param_groups for p in g["params"]]
        return nn.utils.clip_grad_norm_(params, max_norm, norm_type)


def test_sharded_optimizer_plugs_in_through_the_core_protocol() -> None:
    model = nn.Linear(3, 1)
    opt = _FakeSharded(model.parameters(), lr=0.1)
    assert isinstance(opt, ShardedOptimizer) and supports_no_sync(opt)
    wrapper = OptimWrapper(opt, 3, clip_grad={"max_norm": 10.0})
    x = torch.randn(6, 3)
    seen = []
    for i in range(3):
        with wrapper.optim_context(model):
            seen.append(opt.syncing)
            loss = model(x[2 * i : 2 * i + 2]).pow(2).mean()
        wrapper.update_params(loss, num_items=2)
    assert seen == [False, False, True]  # the last micro-batch of the window synchronises
    assert opt.log == ["no_sync", "no_sync", ("scale", pytest.approx(1 / 6)), ("clip", 10.0, 2.0)]
    # ColossalAI API: same optimizer, no_sync around non-final backward calls
    opt.log.clear()
    optim = GradAccumOptimizer(opt, 2, model)
    for _ in range(2):
        optim.backward(model(x[:2]).pow(2).mean(), weight=2)
    assert optim.clip_grad_norm(model, 5.0) is not None
    assert opt.log == ["no_sync", ("scale", pytest.approx(1 / 4)), ("clip", 5.0, 2.0)]


def test_scale_gradients_default_path_and_no_sync_on_plain_objects() -> None:
    model = nn.Linear(2, 2)
    model(torch.ones(1, 2)).sum().backward()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.grad.clone() for p in model.parameters()]
    scale_gradients(opt, 0.5)
    for p, b in zip(model.parameters(), before, strict=True):
        torch.testing.assert_close(p.grad, b * 0.5)
    assert not supports_no_sync(model) and not supports_no_sync(opt)
    with no_sync(model, opt, None):
        pass


def test_load_state_dict_with_other_counts_warns_and_bad_state_errors() -> None:
    model = nn.Linear(2, 1)
    saved = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), 4).state_dict()
    with pytest.warns(AccumulationWarning, match="saved with 4 micro-batches per window"):
        OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), 2).load_state_dict(saved)
    saved["accumulation"] = {"counts": 4}
    with pytest.raises(AccumulationError, match="lacks"):
        OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), 4).load_state_dict(saved)


def test_epoch_cut_short_warns_and_next_before_iter_errors() -> None:
    model = nn.Linear(2, 1)
    batches = [torch.randn(2, 2) for _ in range(5)]
    optim, loader, _, _ = accumulate_gradient(
        model, torch.optim.SGD(model.parameters(), lr=0.1), batches, 3, drop_last=False
    )
    for i, x in enumerate(loader):
        optim.backward(model(x).sum())
        optim.step()
        if i == 3:
            break  # one micro-batch into the second window
    with pytest.warns(AccumulationWarning, match="new epoch starts with 1 micro-batch"):
        iter(loader)
    with pytest.raises(TypeError, match="call iter"):
        next(GradAccumDataloader(batches, 2))
