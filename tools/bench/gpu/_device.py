# SPDX-License-Identifier: Apache-2.0
"""The device side of ``bench_fused_gpu.py``: whether it can run here, the device copy bandwidth, CUDA-event
timing of interleaved contenders.
"""

from __future__ import annotations

import math
import statistics
import subprocess
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["hbm_bandwidth", "nvidia_driver_version", "time_gpu", "why_no_gpu"]


def why_no_gpu() -> str | None:
    """Why the GPU benchmark cannot run in this process (what to install), or None when it can."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build; install a CUDA build of torch"
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False (no driver or no visible device)"
    try:
        from stepforge.fused import _backend as _cuda_runtime
    except ImportError as exc:
        return f"stepforge-fused is not installed ({exc})"
    if not _cuda_runtime.cuda_available():
        return _cuda_runtime.cuda_status()
    return None


def nvidia_driver_version() -> str | None:
    """The NVIDIA driver's version as ``nvidia-smi`` reports it (e.g. ``580.159.04``), None without it."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return out.strip().splitlines()[0] if out.strip() else None


def hbm_bandwidth(numel: int = 1 << 29) -> dict[str, Any]:
    """Device-to-device copy of ``numel`` fp32 elements, read + write counted (GB/s), best of 10."""
    src = torch.randn(numel, device="cuda")
    dst = torch.empty_like(src)
    best = math.inf
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end))
    del src, dst
    torch.cuda.empty_cache()
    return {"copy_gb_per_s": 2 * numel * 4 / (best * 1e-3) / 1e9, "bytes": 2 * numel * 4}


def time_gpu(fns: dict[str, Callable[[], Any]], *, warmup: int, repeats: int, inner: int) -> dict[str, dict]:
    """Median milliseconds per step of each callable: CUDA events around ``inner`` steps, interleaved."""
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    for _ in range(repeats):
        for name, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            samples[name].append(start.elapsed_time(end) / inner)
    return {
        k: {"median_ms": statistics.median(v), "min_ms": min(v), "samples_ms": v} for k, v in samples.items()
    }
