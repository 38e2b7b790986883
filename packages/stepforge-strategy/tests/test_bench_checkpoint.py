# SPDX-License-Identifier: Apache-2.0
"""``tools/bench/bench_checkpoint.py`` runs end to end at 1 MB (the README's numbers come from it at 1 GB): every
row is timed, the committed load returns the saved tensors, and nothing is left in its directory."""

from __future__ import annotations

import importlib.util
import os
import pathlib

import pytest

ROOT = pathlib.Path(os.environ.get("STEPFORGE_SOURCE_ROOT") or pathlib.Path(__file__).resolve().parents[3])
SCRIPT = ROOT / "tools" / "bench" / "bench_checkpoint.py"


@pytest.mark.skipif(not SCRIPT.is_file(), reason="needs the source tree's tools/bench (an sdist has none)")
def test_the_checkpoint_benchmark_runs_at_one_megabyte(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_checkpoint", SCRIPT)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    # raises if the loaded tensors differ from the saved ones
    report = bench.run(1.0, 1, str(tmp_path), sync=False)
    assert report["bytes"] == 1024 * 1024
    rows = {"dcp_save_raw", "save_committed", "verify", "load_committed", "dcp_load_raw", "crc32_memory"}
    assert rows <= set(report["seconds"]) and all(report["seconds"][r] > 0 for r in rows)
    assert os.listdir(tmp_path) == []
