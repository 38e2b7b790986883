# SPDX-License-Identifier: Apache-2.0
"""``tools/bench/train/bench_train_interleaved.py``'s statistics: the per-block-pair speed ratio to the plain loop, its
mean, 95 % Student-t interval and median, against values worked out by hand. (The bench itself runs in CI's
bench_smoke session at ``--tiny``.)"""

from __future__ import annotations

import pytest

from bench.train import bench_train_interleaved as bench


def test_paired_ratios_by_hand():
    # blocks of the loop 2 s each; the contender's 1, 2 and 4 s: ratios 2, 1, 0.5 (loop time / contender time)
    got = bench.paired_ratios([2.0, 2.0, 2.0], [1.0, 2.0, 4.0])
    assert got["ratios"] == [2.0, 1.0, 0.5]
    assert got["mean"] == pytest.approx(3.5 / 3)
    assert got["median"] == 1.0
    # sample sd: sqrt(((5/6)^2 + (1/6)^2 + (2/3)^2) / 2) = sqrt(7/12); t(0.975, 2 dof) = 4.30
    half = 4.30 * (7 / 12) ** 0.5 / 3**0.5
    assert got["ci95"] == pytest.approx([3.5 / 3 - half, 3.5 / 3 + half])


def test_identical_blocks_give_a_zero_width_interval():
    got = bench.paired_ratios([1.5, 1.2, 1.1, 1.3], [1.5, 1.2, 1.1, 1.3])
    assert got["mean"] == 1.0 and got["ci95"] == [1.0, 1.0] and got["median"] == 1.0


def test_student_t_quantiles_fall_back_to_the_nearest_smaller_table_row():
    assert bench._t95(1) == 12.71
    assert bench._t95(13) == 2.18  # between 12 and 15: the larger quantile (a wider, safe interval)
    assert bench._t95(500) == 1.96
