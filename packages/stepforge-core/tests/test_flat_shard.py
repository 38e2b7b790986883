# SPDX-License-Identifier: Apache-2.0
"""``FlatShard``: a flat range seen in the tensor's shape, as DCP writes and reads it."""

from __future__ import annotations

import itertools
import math
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from stepforge.core.flat_shard import FlatShard, flat_range_boxes

SHAPES = [(), (7,), (3, 4), (2, 3, 5), (2, 1, 3, 2)]


@pytest.mark.parametrize("shape", SHAPES)
def test_the_boxes_of_every_range_cover_it_exactly_in_flat_order(shape):
    n = math.prod(shape)
    for start, stop in itertools.combinations_with_replacement(range(n + 1), 2):
        covered = torch.zeros(shape, dtype=torch.int64)
        order = torch.arange(n).reshape(shape)
        last = start - 1
        boxes = flat_range_boxes(shape, start, stop)
        for offsets, sizes in boxes:
            index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))
            covered[index] += 1
            assert order[index].min() == last + 1  # each box continues where the previous one ended
            last = int(order[index].max())
        want = torch.zeros(n, dtype=torch.int64)
        want[start:stop] = 1
        assert torch.equal(covered.reshape(-1), want), (shape, start, stop, boxes)
        assert len(boxes) <= max(1, 2 * len(shape) - 1)


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*single process")
        return fn(*args, **kwargs)


def test_dcp_writes_the_pieces_in_the_tensors_shape_and_reads_any_other_range(tmp_path):
    full = torch.arange(2 * 3 * 5, dtype=torch.float32).reshape(2, 3, 5)
    flat = full.reshape(-1)
    # three "ranks" of one process: their pieces together form the tensor
    for i, (a, b) in enumerate(((0, 11), (11, 22), (22, 30))):
        _quiet(
            dcp.save,
            {"t": FlatShard(flat[a:b].clone(), a, full.shape)},
            checkpoint_id=str(tmp_path / f"r{i}"),
        )
    _quiet(dcp.save, {"t": full}, checkpoint_id=str(tmp_path / "full"))
    plain = {"t": torch.zeros(2, 3, 5)}
    _quiet(dcp.load, plain, checkpoint_id=str(tmp_path / "r1"))
    assert torch.equal(plain["t"].reshape(-1)[11:22], flat[11:22])  # the saved boxes, where they belong
    piece = FlatShard(torch.zeros(9), 7, full.shape)  # another range, read from a plain save
    _quiet(dcp.load, {"t": piece}, checkpoint_id=str(tmp_path / "full"))
    assert torch.equal(piece.local, flat[7:16])


def test_the_operations_of_a_checkpoint_keep_the_range_and_others_are_refused():
    piece = FlatShard(torch.arange(5.0), 3, (2, 4))
    assert piece.shape == (2, 4) and piece.dtype == torch.float32
    fresh = torch.empty_like(piece)
    assert isinstance(fresh, FlatShard) and fresh.start == 3 and fresh.local.numel() == 5
    fresh.copy_(piece)
    assert torch.equal(fresh.local, piece.local)
    moved = piece.detach().to("cpu", copy=True)
    assert isinstance(moved, FlatShard) and moved.local.data_ptr() != piece.local.data_ptr()
    assert piece.flat().shape == (8,) and piece.flat().local is piece.local
    with pytest.raises(TypeError, match="read .local"):
        torch.add(piece, 1)
    with pytest.raises(ValueError, match="not inside 8 elements"):
        FlatShard(torch.zeros(6), 3, (2, 4))
