# SPDX-License-Identifier: Apache-2.0
"""Smoke test of the main job (examples/train_gpt_demo.py): both halves, the resume, the plot and the summary."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from stepforge.testing.distributed import requires_gloo

ROOT = os.environ.get("STEPFORGE_SOURCE_ROOT") or os.path.abspath(
    os.path.join(os.path.dirname(__file__), "..", "..", "..")
)
DEMO = os.path.join(ROOT, "examples", "train_gpt_demo.py")


def _has_zero2() -> bool:
    from stepforge.core import PLUGINS

    try:
        PLUGINS.get("zero2")
    except Exception:
        return False
    return True


@requires_gloo
def test_demo_smoke(tmp_path):
    out = str(tmp_path / "out")
    proc = subprocess.run(
        [sys.executable, DEMO, "--smoke", "--out", out],
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(os.path.join(out, "gpt_demo.json"), encoding="utf-8") as f:
        summary = json.load(f)
    assert summary["steps"] == 4 and summary["resumed_at_iter"] == 2 * 4  # save at step 2 of 4, accum 4
    assert summary["world_size"] == 2 and summary["plugin"] in ("zero2", "torch_fsdp")
    assert os.path.getsize(summary["png"]) > 1000 and summary["sample"]
    assert summary["tokens_per_s"] > 0 and len(summary["memory"]) == 2
    assert "ByteGPT demo" in proc.stdout and "loss curve" in proc.stdout
    # the fallback is visible in the summary
    assert ("FALLBACK" in proc.stdout) == (summary["plugin"] == "torch_fsdp") == (not _has_zero2())
