# SPDX-License-Identifier: Apache-2.0
"""``tools/bench/bench_train_interleaved.py``'s statistics: the per-block-pair speed ratio to the plain loop, its
mean, 95 % Student-t interval and median, against values worked out by hand. (The bench itself runs in CI's
bench_smoke session at ``--tiny``.)"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys

import pytest

ROOT = pathlib.Path(os.environ.get("STEPFORGE_SOURCE_ROOT") or pathlib.Path(__file__).resolve().parents[3])
SCRIPT = ROOT / "tools" / "bench" / "bench_train_interleaved.py"
pytestmark = pytest.mark.skipif(
    not SCRIPT.is_file(), reason="needs the source tree's tools/bench (an sdist has none)"
)


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_train_interleaved", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    saved = list(sys.path)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved  # the script puts tools/bench and examples first; leave the test's path as it was
    return module


def test_paired_ratios_by_hand(bench):
    # blocks of the loop 2 s each; the contender's 1, 2 and 4 s: ratios 2, 1, 0.5 (loop time / contender time)
    got = bench.paired_ratios([2.0, 2.0, 2.0], [1.0, 2.0, 4.0])
    assert got["ratios"] == [2.0, 1.0, 0.5]
    assert got["mean"] == pytest.approx(3.5 / 3)
    assert got["median"] == 1.0
    # sample sd: sqrt(((5/6)^2 + (1/6)^2 + (2/3)^2) / 2) = sqrt(7/12); t(0.975, 2 dof) = 4.30
    half = 4.30 * (7 / 12) ** 0.5 / 3**0.5
    assert got["ci95"] == pytest.approx([3.5 / 3 - half, 3.5 / 3 + half])


def test_identical_blocks_give_a_zero_width_interval(bench):
    got = bench.paired_ratios([1.5, 1.2, 1.1, 1.3], [1.5, 1.2, 1.1, 1.3])
    assert got["mean"] == 1.0 and got["ci95"] == [1.0, 1.0] and got["median"] == 1.0


def test_student_t_quantiles_fall_back_to_the_nearest_smaller_table_row(bench):
    assert bench._t95(1) == 12.71
    assert bench._t95(13) == 2.18  # between 12 and 15: the larger quantile (a wider, safe interval)
    assert bench._t95(500) == 1.96
