# SPDX-License-Identifier: Apache-2.0
"""Step time of stepforge.optim ``Lamb``/``Lars`` against a per-parameter loop of the same math.

The parameter list is model-shaped: by default 200 tensors with sizes log-spaced from 1 K to 4 M elements
(about 98 M elements in all); ``--case small`` adds a list of many small tensors, where per-tensor overhead
dominates. Each optimizer is warmed up, then baseline and stepforge steps are timed interleaved and the best
and median of ``--reps`` are kept. The ratio printed is ``loop time / stepforge time`` (higher is better).

    python tools/bench/bench_optim.py                       # CPU, both optimizers, JSON to bench_optim.json
    python tools/bench/bench_optim.py --device cuda --out benchmarks/results/optim-h100.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _optim_loop import LoopLamb, LoopLars

from stepforge.optim import Lamb, Lars

__all__ = ["main"]

CASES = {
    "model": dict(count=200, low=1_000, high=4_000_000),
    "small": dict(count=2_000, low=1_000, high=16_000),
}

OPTIMIZERS: dict[
    str, tuple[Callable[..., torch.optim.Optimizer], Callable[..., torch.optim.Optimizer], dict]
] = {
    "Lamb": (Lamb, LoopLamb, dict(lr=1e-3, weight_decay=0.01)),
    "Lars": (Lars, LoopLars, dict(lr=0.1, momentum=0.9, weight_decay=1e-4)),
}


def sizes_for(count: int, low: int, high: int) -> list[int]:
    """``count`` sizes log-spaced from ``low`` to ``high`` (deterministic)."""
    if count == 1:
        return [high]
    step = (math.log(high) - math.log(low)) / (count - 1)
    return [round(math.exp(math.log(low) + i * step)) for i in range(count)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _build(factory, kwargs, sizes, device, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = []
    for n in sizes:
        p = torch.randn(n, generator=gen).to(device=device, dtype=dtype).requires_grad_()
        p.grad = torch.randn(n, generator=gen).to(device=device, dtype=dtype)
        params.append(p)
    return params, factory(params, **kwargs)


def _time_step(opt: torch.optim.Optimizer, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    opt.step()
    _sync(device)
    return time.perf_counter() - start


def bench_one(
    name: str, sizes: list[int], device: torch.device, dtype: torch.dtype, reps: int
) -> dict[str, Any]:
    ours_cls, loop_cls, kwargs = OPTIMIZERS[name]
    loop_params, loop = _build(loop_cls, kwargs, sizes, device, dtype)
    ours_params, ours = _build(ours_cls, kwargs, sizes, device, dtype)
    # Same math: after one identical step from identical inputs the parameters agree to rounding.
    loop.step()
    ours.step()
    diff = max(float((a - b).detach().abs().max()) for a, b in zip(loop_params, ours_params, strict=True))
    loop_times, ours_times = [], []
    for _ in range(reps):  # interleaved, so load changes on a shared machine hit both alike
        loop_times.append(_time_step(loop, device))
        ours_times.append(_time_step(ours, device))
    result = {
        "optimizer": name,
        "kwargs": kwargs,
        "loop_best_s": min(loop_times),
        "loop_median_s": statistics.median(loop_times),
        "stepforge_best_s": min(ours_times),
        "stepforge_median_s": statistics.median(ours_times),
        "ratio_best": min(loop_times) / min(ours_times),
        "ratio_median": statistics.median(loop_times) / statistics.median(ours_times),
        "max_abs_diff_after_one_step": diff,
    }
    del loop_params, ours_params, loop, ours
    return result


def machine(device: torch.device) -> dict[str, Any]:
    info = {
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    else:
        try:
            load = os.getloadavg()
            info["loadavg_1_5_15"] = [round(x, 2) for x in load]
        except OSError:
            pass
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=list(OPTIMIZERS))
    parser.add_argument("--case", nargs="+", default=["model"], choices=list(CASES))
    parser.add_argument("--tensors", type=int, help="override the tensor count of every case")
    parser.add_argument("--max-numel", type=int, help="override the largest tensor size of every case")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (CPU)")
    parser.add_argument("--target", type=float, default=3.0, help="ratio the issue asks for")
    parser.add_argument("--out", type=Path, default=Path("bench_optim.json"))
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    results = []
    for case in args.case:
        spec = dict(CASES[case])
        if args.tensors:
            spec["count"] = args.tensors
        if args.max_numel:
            spec["high"] = args.max_numel
        sizes = sizes_for(**spec)
        for name in args.optimizers:
            r = bench_one(name, sizes, device, dtype, args.reps)
            r.update(
                case=case,
                tensors=len(sizes),
                min_numel=min(sizes),
                max_numel=max(sizes),
                total_numel=sum(sizes),
                dtype=args.dtype,
            )
            results.append(r)
            print(
                f"{case:>5} {name:<4} {len(sizes)} tensors, {sum(sizes) / 1e6:.1f} M elements: "
                f"loop {r['loop_best_s'] * 1e3:8.1f} ms  stepforge {r['stepforge_best_s'] * 1e3:8.1f} ms  "
                f"ratio {r['ratio_best']:.2f}x best / {r['ratio_median']:.2f}x median "
                f"(target {args.target:g}x; max |diff| after 1 step {r['max_abs_diff_after_one_step']:.1e})"
            )
    report = {
        "benchmark": "stepforge.optim vs per-parameter loop",
        "machine": machine(device),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
