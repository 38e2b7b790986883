# SPDX-License-Identifier: Apache-2.0
"""The wave and segment planning behind the multi-tensor updates."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stepforge.optim._multi_tensor import plan_waves, segment_norms, split_segments


@settings(max_examples=50, deadline=None)
@given(
    numels=st.lists(st.integers(1, 50), min_size=1, max_size=12),
    chunk=st.one_of(st.none(), st.integers(1, 40)),
)
def test_waves_cover_every_element_once_in_order(numels, chunk):
    waves = plan_waves(numels, chunk, torch.device("cpu"))
    covered = [(p.index, i) for w in waves for p in w.pieces for i in range(p.start, p.stop)]
    assert covered == [(t, i) for t, n in enumerate(numels) for i in range(n)]
    if chunk is not None:
        assert all(sum(p.stop - p.start for p in w.pieces) <= chunk for w in waves)
        assert all(w.owners.tolist() == [p.index for p in w.pieces] for w in waves)
    else:
        assert len(waves) == 1 and waves[0].owners is None


@settings(max_examples=30, deadline=None)
@given(numels=st.lists(st.integers(1, 30), min_size=1, max_size=10), chunk=st.integers(1, 25))
def test_segment_norms_equal_whole_tensor_norms(numels, chunk):
    tensors = [torch.randn(n, dtype=torch.float64) for n in numels]
    waves = plan_waves(numels, chunk, torch.device("cpu"))
    pieces = [(w, [tensors[p.index][p.start : p.stop].norm() for p in w.pieces]) for w in waves]
    got = segment_norms(pieces, len(numels), torch.device("cpu"), torch.float64)
    torch.testing.assert_close(got, torch.stack([t.norm() for t in tensors]))


def test_split_segments():
    ts = [torch.empty(n) for n in (3, 4, 10, 1, 1, 2)]
    sizes = [[t.numel() for t in seg] for seg in split_segments(ts, 2)]  # runs of at most 4 * 2 elements
    assert sizes == [[3, 4], [10], [1, 1, 2]]
    assert split_segments(ts, None) == [ts]
