# SPDX-License-Identifier: Apache-2.0
"""The layout cache of the operators' real implementations: a repeated call reuses the accepted layout, and any
change of a tensor's address, element count, dtype, device or contiguity runs the full checks again (so a bad
call after good ones still fails with the checks' message); the cache holds no tensors and stays bounded."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from stepforge.fused._operators import layouts

OPS = torch.ops.stepforge_fused
SHAPES = [(5, 7), (13,), (2, 3, 4)]


def _adam(params, grads, exp_avgs, exp_avg_sqs):  # type: ignore[no-untyped-def]
    steps = torch.zeros(len(params))
    OPS.adam_(
        params, grads, exp_avgs, exp_avg_sqs, [], steps, 1e-2, None,
        0.9, 0.999, 1e-8, 0.01, True, True, 1.0, None, None, False, False, 0,
    )  # fmt: skip


def _lists(seed: int = 0) -> tuple[list[torch.Tensor], ...]:
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen) for s in SHAPES]
    grads = [torch.randn(s, generator=gen) for s in SHAPES]
    return params, grads, [torch.zeros(s) for s in SHAPES], [torch.zeros(s) for s in SHAPES]


@pytest.fixture(autouse=True)
def _empty_cache() -> None:
    layouts.clear()


def test_a_repeated_call_is_served_by_its_layout_and_steps_as_a_checked_one() -> None:
    """Two steps with the cache equal two steps with the cache emptied before each (the full checks every time),
    bit for bit; the second call added no layout."""
    cached, fresh = _lists(), _lists()
    for _ in range(2):
        _adam(*cached)
        assert layouts.size() == (1, 4 * len(SHAPES))
        layouts.clear()
        _adam(*fresh)
        layouts.clear()
    for a, b in zip(cached, fresh, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert any(not torch.equal(p, q) for p, q in zip(cached[0], _lists()[0], strict=True))  # it stepped


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (lambda g: g.double(), TypeError, r"grads\[1\] has dtype torch.float64"),
        (lambda g: torch.zeros(g.numel() + 1), ValueError, r"grads\[1\] has 14 elements"),
        (lambda g: torch.zeros(13, 2).t()[0], RuntimeError, r"grads\[1\] is not contiguous"),
    ],
    ids=["dtype", "numel", "non-contiguous"],
)
def test_a_changed_tensor_after_an_accepted_call_is_checked_again(change, error, match) -> None:  # type: ignore[no-untyped-def]
    """The same lists accepted once, then one gradient replaced by one of another dtype, size or a strided view:
    the call raises the checks' own error naming the entry, and nothing was stepped."""
    params, grads, m, v = _lists()
    _adam(params, grads, m, v)
    before = [p.clone() for p in params]
    bad = list(grads)
    bad[1] = change(grads[1])
    with pytest.raises(error, match=match):
        _adam(params, bad, m, v)
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))


def test_a_strided_view_at_the_same_address_is_not_served() -> None:
    """A transposed gradient shares the accepted one's address and element count: it is refused, not stepped."""
    params, grads = [torch.randn(4, 4) for _ in range(2)], [torch.randn(4, 4) for _ in range(2)]
    m, v = [torch.zeros(4, 4) for _ in range(2)], [torch.zeros(4, 4) for _ in range(2)]
    _adam(params, grads, m, v)
    before = [p.clone() for p in params]
    with pytest.raises(RuntimeError, match=r"grads\[0\] is not contiguous"):
        _adam(params, [grads[0].t(), grads[1]], m, v)
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))


def test_the_cache_holds_no_tensor_and_is_bounded() -> None:
    """A stepped tensor is freed when its owner drops it; more layouts than :data:`MAX_LAYOUTS` keep at most that
    many."""
    params, grads, m, v = _lists()
    ref = weakref.ref(params[0])
    _adam(params, grads, m, v)
    del params
    gc.collect()
    assert ref() is None
    keep = []  # distinct live tensors, so every layout has its own addresses
    for i in range(layouts.MAX_LAYOUTS + 5):
        lists = _lists(i)
        keep.append(lists)
        _adam(*lists)
    assert layouts.size()[0] == layouts.MAX_LAYOUTS
