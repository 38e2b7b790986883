# SPDX-License-Identifier: Apache-2.0
"""``stepforge.zero.comm.buffers``' bucket layout: a gradient written into a bucket's rank-major rows (divided,
padded, this rank's row moved last for the exchange). Expected values are written out by hand."""

from __future__ import annotations

import pytest
import torch

from stepforge.zero.comm.buffers import write_own_row_last, write_rank_major


def test_write_rank_major_pads_and_divides_into_strided_rows():
    # 7 elements over 4 ranks, piece 2: rows [1 2] [3 4] [5 6] [7 0] of the gradient halved, in a column slice
    table = torch.full((4, 5), -1.0)
    write_rank_major(table[:, 1:3], torch.arange(1.0, 8.0), 2)
    expected = torch.tensor(
        [[-1, 0.5, 1, -1, -1], [-1, 1.5, 2, -1, -1], [-1, 2.5, 3, -1, -1], [-1, 3.5, 0, -1, -1]]
    )
    assert torch.equal(table, expected)


@pytest.mark.parametrize(
    "rank, rows",
    [
        # own row (rank 0's piece [1 2]) last, the others in rank order
        (0, [[3, 4], [5, 6], [7, 0], [1, 2]]),
        (1, [[1, 2], [5, 6], [7, 0], [3, 4]]),
        (2, [[1, 2], [3, 4], [7, 0], [5, 6]]),
        (3, [[1, 2], [3, 4], [5, 6], [7, 0]]),
    ],
)
def test_write_own_row_last_moves_this_ranks_row_to_the_end(rank: int, rows: list[list[float]]):
    table = torch.full((4, 2), -1.0)
    write_own_row_last(table, torch.arange(1.0, 8.0), 1, rank)
    assert torch.equal(table, torch.tensor(rows, dtype=torch.float32))


def test_write_own_row_last_zero_fills_rows_past_a_short_gradient():
    # 3 elements over 4 ranks (piece 1): rank 3's piece is padding, rank 1 keeps its own row last
    table = torch.full((4, 1), -1.0)
    write_own_row_last(table, torch.tensor([2.0, 4.0, 6.0]), 2, 1)
    assert torch.equal(table.view(-1), torch.tensor([1.0, 3.0, 0.0, 2.0]))
