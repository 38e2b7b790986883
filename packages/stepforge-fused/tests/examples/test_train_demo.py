# SPDX-License-Identifier: Apache-2.0
"""The README's main job (examples/train_demo.py) runs end to end and reports what it promises."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(os.environ.get("STEPFORGE_SOURCE_ROOT") or pathlib.Path(__file__).resolve().parents[4])
DEMO = ROOT / "examples" / "train_demo.py"

pytest.importorskip("sklearn", reason="the demo's data set comes from scikit-learn (fused test group)")


def test_demo_smoke_run_trains_all_three_optimizers(tmp_path):
    result = subprocess.run(
        [sys.executable, str(DEMO), "--smoke", "--no-progress", "--threads", "1", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "train_demo.png").stat().st_size > 0
    report = json.loads((tmp_path / "train_demo.json").read_text())
    results = {r["name"]: r for r in report["results"]}
    assert set(results) == {"CPUAdam", "FusedLAMB", "AdamW"}
    for name, r in results.items():
        assert r["error"] is None, (name, r["error"])
        assert r["test_acc"][-1] > 0.5, (name, r["test_acc"])  # 4 steps already beat chance (0.1) by far
        assert all(ms > 0 for ms in r["step_ms"])
    assert report["bit_identical_to_adamw"] == {"CPUAdam": True}
    assert "speed-up" in result.stdout
