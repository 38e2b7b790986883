# SPDX-License-Identifier: Apache-2.0
"""Where and with what a benchmark ran: time stamps, load average, CPU/ISA/caches, versions, git commit.

Imported by the scripts as ``_machine``.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["available_memory_bytes", "load_average", "machine_info", "utc_now"]


def utc_now() -> str:
    """ISO-8601 UTC time stamp, seconds precision."""
    return _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages (empty where the OS has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def _cpuinfo() -> dict[str, Any]:
    info: dict[str, Any] = {"model": platform.processor() or platform.machine()}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    first = text.split("\n\n", 1)[0]
    fields = {}
    for line in first.splitlines():
        if ":" in line:
            k, _, v = line.partition(":")
            fields[k.strip()] = v.strip()
    info["model"] = fields.get("model name", info["model"])
    info["vendor"] = fields.get("vendor_id")
    info["family_model_stepping"] = [fields.get("cpu family"), fields.get("model"), fields.get("stepping")]
    flags = set(fields.get("flags", "").split())
    info["isa_flags"] = sorted(
        flags & {"sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16"}
    )
    info["hypervisor"] = "hypervisor" in flags
    caches = {}
    for idx in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level = (idx / "level").read_text().strip()
            kind = (idx / "type").read_text().strip()
            size = (idx / "size").read_text().strip()
        except OSError:
            continue
        if kind != "Instruction":
            caches[f"L{level}"] = size
    info["caches_cpu0"] = caches
    return info


def _meminfo_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def available_memory_bytes() -> int | None:
    """The machine's ``MemAvailable`` in bytes (what can be allocated without swapping); ``None`` without ``/proc``."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def machine_info(threads: int | None = None) -> dict[str, Any]:
    """Where and with what a benchmark ran: CPU, cores, memory, load, torch and stepforge versions, git commit."""
    import torch

    cpu = _cpuinfo()
    return {
        "date_utc": utc_now(),
        "cpu": cpu,
        "device": f"{cpu['model']}, {os.cpu_count()} logical cores",
        "logical_cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_gib": _meminfo_gib(),
        "load_average": load_average(),
        "threads": threads if threads is not None else torch.get_num_threads(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cpu_capability": getattr(torch.backends.cpu, "get_cpu_capability", lambda: None)(),
        "numpy": _dist_version("numpy"),
        "stepforge": {
            d: _dist_version(d)
            for d in ("stepforge-core", "stepforge-optim", "stepforge-fused")
            if _dist_version(d) is not None
        },
        "env": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "STEPFORGE_CPU_ISA") if k in os.environ},
        "git_commit": _git_commit(),
    }
