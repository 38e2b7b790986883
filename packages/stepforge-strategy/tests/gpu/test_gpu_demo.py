# SPDX-License-Identifier: Apache-2.0
"""The main job (``examples/train_gpt_demo.py``) on the GPU at its smoke size: ``--device cuda --nproc 1``
(NCCL, the batches on the device, stepforge-fused's ``FusedAdam`` on the fp32 master pieces of ``zero2``), the
resume in new processes bitwise, and the summary naming the device beside tokens/s."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

ROOT = os.environ.get("STEPFORGE_SOURCE_ROOT") or os.path.abspath(
    os.path.join(os.path.dirname(__file__), "..", "..", "..", "..")
)
DEMO = os.path.join(ROOT, "examples", "train_gpt_demo.py")


def test_demo_smoke_on_cuda(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = str(tmp_path / "out")
    proc = subprocess.run(
        [sys.executable, DEMO, "--smoke", "--device", "cuda", "--nproc", "1", "--out", out],
        capture_output=True,
        text=True,
        timeout=500,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(os.path.join(out, "gpt_demo.json"), encoding="utf-8") as f:
        summary = json.load(f)
    assert summary["device"].startswith("cuda") and summary["backend"] == "nccl" and summary["gpu"]
    assert summary["world_size"] == 1 and summary["optimizer"] == "FusedAdam"
    assert summary["plugin"] == "zero2" and summary["resume_identical"] and summary["resume_within_bound"]
    assert summary["tokens_per_s"] > 0 and summary["memory"][0]["cuda_peak_mb"] > 0
    assert f"tokens/s on {summary['device']}" in proc.stdout and "(torchrun, nccl)" in proc.stdout
