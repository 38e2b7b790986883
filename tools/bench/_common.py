# SPDX-License-Identifier: Apache-2.0
"""Shared helpers of the stepforge benchmark scripts in ``tools/bench/``.

One job: measure honestly and record what was measured where.

- :func:`configure_threads` sets the intra-op thread count. torch ships its own ``libgomp`` and a process loads
  one OpenMP runtime, so ``torch.set_num_threads`` also governs stepforge's OpenMP kernels.
- :func:`time_interleaved` times several callables round-robin (A, B, A, B, ...) after a warm-up, with the
  garbage collector off, and reports the median of the repeats. On a shared machine the load changes over
  seconds; interleaving lets every contender see the same load, so the *ratios* are the numbers to trust.
- :func:`adam_pattern_ceiling` and :func:`triad_bandwidth` measure the memory bandwidth the optimizer kernels
  are judged against (see tools/bench/README.md).
- :func:`machine_info`, :func:`save_json`, :func:`format_table` and :func:`save_ratio_plot` record the run.

The scripts import this module as ``_common`` (``python tools/bench/<script>.py`` puts ``tools/bench`` first on
``sys.path``).
"""

from __future__ import annotations

import datetime as _dt
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = [
    "Timing",
    "adam_pattern_ceiling",
    "configure_threads",
    "format_table",
    "load_average",
    "machine_info",
    "save_json",
    "save_ratio_plot",
    "time_interleaved",
    "triad_bandwidth",
    "utc_now",
]

ADAM_PATTERN_BYTES = 28  # fp32 p, g, m, v read (16 B) + p, m, v written back in place (12 B)
TRIAD_BYTES = 12  # STREAM convention: b, c read + a written (the write-allocate read is not counted)


# --------------------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------------------
@dataclass
class Timing:
    """Wall-clock samples of one callable, in milliseconds."""

    samples_ms: list[float] = field(default_factory=list)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ms) if self.samples_ms else math.nan

    @property
    def min_ms(self) -> float:
        return min(self.samples_ms) if self.samples_ms else math.nan

    @property
    def spread(self) -> float:
        """(p75 - p25) / median: how noisy the samples were (0.05 = 5 %)."""
        if len(self.samples_ms) < 4:
            return math.nan
        q = statistics.quantiles(self.samples_ms, n=4)
        return (q[2] - q[0]) / self.median_ms

    def to_dict(self) -> dict[str, Any]:
        return {
            "median_ms": self.median_ms,
            "min_ms": self.min_ms,
            "iqr_over_median": self.spread,
            "samples_ms": [round(s, 4) for s in self.samples_ms],
        }


def time_interleaved(
    fns: Mapping[str, Callable[[], Any]],
    *,
    warmup: int = 2,
    repeats: int = 10,
    before: Mapping[str, Callable[[], Any]] | None = None,
) -> dict[str, Timing]:
    """Time each callable ``repeats`` times, round-robin, after ``warmup`` untimed calls each.

    Args:
        fns: name -> the call to time (e.g. ``optimizer.step``).
        warmup: untimed calls per callable first (the first optimizer step allocates its state).
        repeats: timed calls per callable; report the median.
        before: name -> an untimed call made right before each call of ``fns[name]`` (e.g. handing the
            optimizer a fresh set of gradients).

    Returns:
        name -> :class:`Timing`.
    """
    before = before or {}
    noop: Callable[[], Any] = lambda: None  # noqa: E731
    out = {name: Timing() for name in fns}
    gc_was_enabled = gc.isenabled()
    try:
        for _ in range(warmup):
            for name, fn in fns.items():
                before.get(name, noop)()
                fn()
        gc.collect()
        gc.disable()  # a collection inside a timed call would be charged to whoever triggered it
        for _ in range(repeats):
            for name, fn in fns.items():
                before.get(name, noop)()
                t0 = time.perf_counter_ns()
                fn()
                out[name].samples_ms.append((time.perf_counter_ns() - t0) / 1e6)
    finally:
        if gc_was_enabled:
            gc.enable()
    return out


# --------------------------------------------------------------------------------------------------------
# threads, bandwidth
# --------------------------------------------------------------------------------------------------------
def configure_threads(threads: int | None) -> int:
    """Set torch's intra-op thread count (which also drives stepforge's OpenMP kernels); returns it."""
    import torch

    if threads is None or threads <= 0:
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(threads)
    return torch.get_num_threads()


def _split(n: int, parts: int) -> list[tuple[int, int]]:
    step = -(-n // parts)
    return [(lo, min(n, lo + step)) for lo in range(0, n, step)]


def adam_pattern_ceiling(
    n: int = 50_000_000,
    *,
    threads: int = 2,
    repeats: int = 5,
    chunks: Sequence[int] = (32_768, 65_536, 131_072),
) -> dict[str, Any]:
    """Bandwidth of the Adam access pattern with trivial math: the ceiling for a memory-bound Adam kernel.

    Per element four fp32 arrays ``p, g, m, v`` are read once from DRAM and ``p, m, v`` written back in place
    (28 B). Each of ``threads`` Python threads walks its own contiguous slice in cache-sized chunks and runs
    ``m += g; v += g; p += m`` on each chunk with numpy (which releases the GIL): the second and third
    touches hit L2, so DRAM sees exactly the 4-read/3-write pattern. The best chunk size wins (a ceiling).

    Returns:
        ``{"gb_per_s", "ms", "elements", "bytes_per_element", "threads", "chunk", "by_chunk"}``.
    """
    import numpy as np
    import torch

    # torch-allocated memory viewed by numpy: the page size the optimizers' tensors have (numpy itself would
    # ask for transparent huge pages on large arrays, torch does not unless THP_MEM_ALLOC_ENABLE=1)
    gen = torch.Generator().manual_seed(0)
    p, g, m, v = (torch.randn(n, generator=gen).mul_(1e-3).numpy() for _ in range(4))

    def work(lo: int, hi: int, chunk: int) -> None:
        for s in range(lo, hi, chunk):
            e = min(hi, s + chunk)
            pb, gb, mb, vb = p[s:e], g[s:e], m[s:e], v[s:e]
            np.add(mb, gb, out=mb)
            np.add(vb, gb, out=vb)
            np.add(pb, mb, out=pb)

    by_chunk: dict[int, float] = {}
    with ThreadPoolExecutor(max_workers=threads) as pool:
        for chunk in chunks:

            def run(chunk: int = chunk) -> None:
                for f in [pool.submit(work, lo, hi, chunk) for lo, hi in _split(n, threads)]:
                    f.result()

            by_chunk[chunk] = time_interleaved({"x": run}, warmup=1, repeats=repeats)["x"].median_ms
    best = min(by_chunk, key=by_chunk.__getitem__)
    ms = by_chunk[best]
    return {
        "gb_per_s": ADAM_PATTERN_BYTES * n / (ms * 1e-3) / 1e9,
        "ms": ms,
        "elements": n,
        "bytes_per_element": ADAM_PATTERN_BYTES,
        "threads": threads,
        "chunk": best,
        "by_chunk_ms": {str(k): v for k, v in by_chunk.items()},
        "method": "numpy m+=g; v+=g; p+=m on L2-sized chunks of torch-allocated arrays, one thread per core",
    }


def triad_bandwidth(n: int = 50_000_000, *, threads: int = 2, repeats: int = 5) -> dict[str, Any]:
    """STREAM-like triad ``a = b + s * c`` (fp32), counted as 12 B per element, two ways.

    ``numpy``: one Python thread per core over its slice, ``s * c`` into an L1-sized scratch buffer first.
    ``torch``: ``torch.add(b, c, alpha=s, out=a)`` on the whole arrays (torch's own threading).

    Returns:
        ``{"gb_per_s"(best of both), "numpy_gb_per_s", "torch_gb_per_s", ...}``.
    """
    import numpy as np
    import torch

    gen = torch.Generator().manual_seed(1)
    a = torch.zeros(n).numpy()  # torch-allocated, as in adam_pattern_ceiling
    b = torch.randn(n, generator=gen).numpy()
    c = torch.randn(n, generator=gen).numpy()
    chunk = 65_536

    def work(lo: int, hi: int) -> None:
        tmp = np.empty(chunk, dtype=np.float32)
        for s in range(lo, hi, chunk):
            e = min(hi, s + chunk)
            t = tmp[: e - s]
            np.multiply(c[s:e], np.float32(3.0), out=t)
            np.add(b[s:e], t, out=a[s:e])

    ta, tb, tc = torch.from_numpy(a), torch.from_numpy(b), torch.from_numpy(c)
    with ThreadPoolExecutor(max_workers=threads) as pool:

        def run_np() -> None:
            for f in [pool.submit(work, lo, hi) for lo, hi in _split(n, threads)]:
                f.result()

        t = time_interleaved(
            {"numpy": run_np, "torch": lambda: torch.add(tb, tc, alpha=3.0, out=ta)},
            warmup=1,
            repeats=repeats,
        )
    gbs = {k: TRIAD_BYTES * n / (v.median_ms * 1e-3) / 1e9 for k, v in t.items()}
    return {
        "gb_per_s": max(gbs.values()),
        "numpy_gb_per_s": gbs["numpy"],
        "torch_gb_per_s": gbs["torch"],
        "elements": n,
        "bytes_per_element": TRIAD_BYTES,
        "threads": threads,
    }


# --------------------------------------------------------------------------------------------------------
# recording
# --------------------------------------------------------------------------------------------------------
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


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, Timing):
        return obj.to_dict()
    if hasattr(obj, "__dataclass_fields__"):
        return _jsonable(asdict(obj))
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None  # JSON has no NaN/inf
    return obj


def save_json(path: str | os.PathLike[str], payload: Mapping[str, Any]) -> Path:
    """Write ``payload`` as indented JSON (NaN/inf become null), creating parent folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_jsonable(payload), indent=2) + "\n")
    return path


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, str, str]]) -> str:
    """A plain-text table.

    Args:
        rows: dicts of values.
        columns: ``(key, header, format)``; ``format`` is a format spec (``".2f"``) or ``""`` for ``str``.
            Missing or None values print as ``-``.
    """
    cells = [[h for _, h, _ in columns]]
    for row in rows:
        line = []
        for key, _, spec in columns:
            v = row.get(key)
            if v is None or (isinstance(v, float) and math.isnan(v)):
                line.append("-")
            else:
                line.append(format(v, spec) if spec else str(v))
        cells.append(line)
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    out = []
    for i, r in enumerate(cells):
        out.append(
            "  ".join(
                c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths, strict=True))
            )
        )
        if i == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def save_ratio_plot(
    path: str | os.PathLike[str],
    rows: Sequence[Mapping[str, Any]],
    *,
    title: str,
    ceiling_gb_per_s: float | None = None,
) -> Path:
    """Two panels: speed-up over the baseline per case (target marked), and effective GB/s (ceiling marked).

    Each row needs ``case``, ``ratio``; optional ``target``, ``gb_per_s``, ``baseline_gb_per_s``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [r for r in rows if r.get("ratio") is not None and math.isfinite(r["ratio"])]
    labels = [r["case"] for r in rows]
    y = list(range(len(rows)))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 0.45 * len(rows) + 2.2), sharey=True)
    colors = [
        "tab:green" if r.get("met") else ("tab:red" if r.get("met") is False else "tab:gray") for r in rows
    ]
    ax1.barh(y, [r["ratio"] for r in rows], color=colors)
    for yi, r in zip(y, rows, strict=True):
        if r.get("target"):
            ax1.plot([r["target"], r["target"]], [yi - 0.4, yi + 0.4], color="black", lw=2)
        ax1.text(r["ratio"], yi, f" {r['ratio']:.2f}x", va="center", fontsize=8)
    ax1.axvline(1.0, color="gray", ls=":", lw=1)
    ax1.set_xscale("log")
    if rows:
        hi = max(max(r["ratio"] for r in rows), max((r.get("target") or 1.0) for r in rows))
        ax1.set_xlim(min(0.5, 0.8 * min(r["ratio"] for r in rows)), 2.0 * hi)  # room for the labels
    ax1.set_yticks(y, labels, fontsize=8)
    ax1.invert_yaxis()
    ax1.set_xlabel("speed-up over torch baseline (log; black tick = target)")
    gbs = [r.get("gb_per_s") or 0.0 for r in rows]
    base = [r.get("baseline_gb_per_s") or 0.0 for r in rows]
    ax2.barh([yi - 0.2 for yi in y], gbs, height=0.4, label="stepforge", color="tab:blue")
    ax2.barh([yi + 0.2 for yi in y], base, height=0.4, label="torch baseline", color="tab:orange")
    if ceiling_gb_per_s:
        ax2.axvline(
            ceiling_gb_per_s, color="black", ls="--", lw=1, label=f"ceiling {ceiling_gb_per_s:.0f} GB/s"
        )
    ax2.set_xlabel("effective GB/s (minimum bytes moved / time)")
    ax2.legend(fontsize=8, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
