# SPDX-License-Identifier: Apache-2.0
"""Per-step cost of the pointer-cache revalidation: ``CPUAdam`` of a git ref vs the installed one, side by side.

    python tools/bench/experiments/bench_cache_check.py --ref <commit> --out benchmarks/results/fused-cpu/cpu-<date>-cache-check.json

The Python layer of ``stepforge.fused`` at ``--ref`` (``_base.py``, ``fused_adam.py``, ``cpu_adam.py``, plus
whatever they import that the installed package lacks) is loaded as extra submodules of the installed
``stepforge.fused`` package, so both versions call the same compiled kernels in one process. Both optimizers
step 20 000 x 1 000 float32 tensors round-robin (``reuse``: the same grads every step; ``fresh``: two grad sets
alternating, other tensors at other addresses every step); the median of ``--repeats`` steps is reported.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import stepforge.fused as fused

ROOT = Path(__file__).resolve().parents[3]
SRC = "packages/stepforge-fused/src/stepforge/fused"

#: what `nox -s bench_smoke` runs (tools/bench/smoke.py): HEAD's Python layer against the installed one (the same
#: code twice), every path once, in seconds; no timing is judged
SMOKE_ARGS = (
    "--ref",
    "HEAD",
    "--count",
    "20",
    "--numel",
    "1000",
    "--repeats",
    "1",
    "--warmup",
    "0",
    "--out",
    "{out}/cache-check.json",
)


def _load_old(ref: str) -> type:
    """``CPUAdam`` as of ``ref``, its modules renamed ``<name>_at_ref`` inside the installed package."""
    names = ["_base", "_adam_base", "fused_adam", "cpu_adam"]
    extra = ["_cuda_runtime", "_validate"]
    pkg_dir = Path(fused.__file__).parent
    mods = {}
    for name in extra + names:
        try:
            text = subprocess.check_output(
                ["git", "-C", str(ROOT), "show", f"{ref}:{SRC}/{name}.py"],
                text=True,
                stderr=subprocess.DEVNULL,  # a module the ref does not have is skipped, not an error
            )
        except subprocess.CalledProcessError:
            continue
        for other in extra + names:
            text = text.replace(f"from .{other} import", f"from .{other}_at_ref import")
            text = text.replace(
                f"from . import _backend, {other}\n",
                f"from . import _backend\nfrom . import {other}_at_ref as {other}\n",
            )
        full = f"stepforge.fused.{name}_at_ref"
        spec = importlib.util.spec_from_loader(full, loader=None, origin=str(pkg_dir / f"{name}_at_ref.py"))
        module = importlib.util.module_from_spec(spec)
        module.__package__ = "stepforge.fused"
        sys.modules[full] = module
        exec(compile(text, f"{ref}:{name}.py", "exec"), module.__dict__)
        mods[name] = module
    return mods["cpu_adam"].CPUAdam


def _bundle(count: int, numel: int, sets: int) -> tuple[list[torch.nn.Parameter], list[list[torch.Tensor]]]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(numel, generator=gen)) for _ in range(count)]
    grads = [[torch.randn(numel, generator=gen) * 1e-2 for _ in range(count)] for _ in range(sets)]
    return params, grads


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ref", required=True, help="git commit of the 'before' Python layer")
    ap.add_argument("--count", type=int, default=20_000)
    ap.add_argument("--numel", type=int, default=1_000)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    Old = _load_old(args.ref)
    rows = []
    for mode in ("reuse", "fresh"):
        sets = 2 if mode == "fresh" else 1
        contenders = {}
        for label, cls in (("before", Old), ("after", fused.CPUAdam)):
            params, grads = _bundle(args.count, args.numel, sets)
            for p, g in zip(params, grads[0], strict=True):
                p.grad = g
            contenders[label] = (cls(params, lr=1e-3, weight_decay=0.01), params, grads, [0])
        times: dict[str, list[float]] = {k: [] for k in contenders}
        for i in range(args.warmup + args.repeats):
            for label, (opt, params, grads, flip) in contenders.items():
                if sets == 2:
                    flip[0] ^= 1
                    for p, g in zip(params, grads[flip[0]], strict=True):
                        p.grad = g
                t0 = time.perf_counter()
                opt.step()
                dt = time.perf_counter() - t0
                if i >= args.warmup:
                    times[label].append(dt)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        # the revalidation alone: BucketCache.group_buckets on an unchanged group, round-robin
        check: dict[str, list[float]] = {k: [] for k in contenders}
        for _ in range(args.repeats):
            for label, (opt, _params, _grads, _flip) in contenders.items():
                t0 = time.perf_counter()
                opt._bucket_cache.group_buckets(opt, 0, opt.param_groups[0])
                check[label].append(time.perf_counter() - t0)
        check_med = {k: statistics.median(v) * 1e3 for k, v in check.items()}
        row = {
            "case": f"CPUAdam {args.count} x {args.numel} fp32, grads {mode}",
            "before_ms": round(med["before"], 3),
            "after_ms": round(med["after"], 3),
            "after_over_before": round(med["after"] / med["before"], 4),
            "before_min_ms": round(min(times["before"]) * 1e3, 3),
            "after_min_ms": round(min(times["after"]) * 1e3, 3),
            "after_over_before_min": round(min(times["after"]) / min(times["before"]), 4),
            "revalidation_before_ms": round(check_med["before"], 3),
            "revalidation_after_ms": round(check_med["after"], 3),
            "revalidation_before_min_ms": round(min(check["before"]) * 1e3, 3),
            "revalidation_after_min_ms": round(min(check["after"]) * 1e3, 3),
            "before_all_ms": [round(t * 1e3, 3) for t in times["before"]],
            "after_all_ms": [round(t * 1e3, 3) for t in times["after"]],
        }
        print(
            f"{row['case']}: before {row['before_ms']:.2f} ms, after {row['after_ms']:.2f} ms, "
            f"ratio {row['after_over_before']:.3f}"
        )
        rows.append(row)
        contenders = None
    result = {
        "what": "per-step revalidation of the pointer cache, before vs after, one process",
        "ref_before": args.ref,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "cpu_features": {k: v for k, v in fused.cpu_features().items() if k != "cpu_flags"},
        "repeats": args.repeats,
        "rows": rows,
    }
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
