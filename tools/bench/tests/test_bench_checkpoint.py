# SPDX-License-Identifier: Apache-2.0
"""``tools/bench/checkpoint/bench_checkpoint.py`` runs end to end at 1 MB (the README's numbers come from it at 1 GB):
every row is timed, the committed load returns the saved tensors, and nothing is left in its directory."""

from __future__ import annotations

import os

from bench.checkpoint import bench_checkpoint


def test_the_checkpoint_benchmark_runs_at_one_megabyte(tmp_path):
    # raises if the loaded tensors differ from the saved ones
    report = bench_checkpoint.run(1.0, 1, str(tmp_path), sync=False)
    assert report["bytes"] == 1024 * 1024
    rows = {"dcp_save_raw", "save_committed", "verify", "load_committed", "dcp_load_raw", "crc32_memory"}
    assert rows <= set(report["seconds"]) and all(report["seconds"][r] > 0 for r in rows)
    assert os.listdir(tmp_path) == []
