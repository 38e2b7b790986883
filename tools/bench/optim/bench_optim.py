# SPDX-License-Identifier: Apache-2.0
"""Step time of stepforge.optim ``Lamb``/``Lars`` against a per-parameter loop of the same math.

The parameter list is model-shaped: by default 200 tensors with sizes log-spaced from 1 K to 4 M elements
(about 98 M elements in all); ``--case small`` adds a list of many small tensors, where per-tensor overhead
dominates. Each optimizer is warmed up, then baseline and stepforge steps are timed round-robin with
``tools/bench/common/_timing.py``; the ratio is ``median loop time / median stepforge time`` (higher is better),
and the best-step ratio is printed beside it.

    python tools/bench/optim/bench_optim.py                       # CPU, both optimizers -> bench-out/cpu-<date>-optim.json
    python tools/bench/optim/bench_optim.py --case model small --threads 1 --reps 9
    python tools/bench/optim/bench_optim.py --device cuda
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tools/: the `bench` package

from bench.common import _machine, _report, _timing
from bench.optim._loop import LoopLamb, LoopLars
from stepforge.optim import Lamb, Lars

__all__ = ["main"]

#: what `nox -s bench_smoke` runs (tools/bench/smoke.py): seconds, every code path, no timing judged
SMOKE_ARGS = ("--reps", "1", "--warmup", "0", "--tensors", "4", "--max-numel", "4096", "--out", "{out}")

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


def _stepper(opt: torch.optim.Optimizer, device: torch.device) -> Callable[[], None]:
    def step() -> None:
        opt.step()
        _sync(device)

    return step


def bench_one(
    name: str, sizes: list[int], device: torch.device, dtype: torch.dtype, reps: int, warmup: int
) -> dict[str, Any]:
    ours_cls, loop_cls, kwargs = OPTIMIZERS[name]
    loop_params, loop = _build(loop_cls, kwargs, sizes, device, dtype)
    ours_params, ours = _build(ours_cls, kwargs, sizes, device, dtype)
    # Same math: after one identical step from identical inputs the parameters agree to rounding.
    loop.step()
    ours.step()
    diff = max(float((a - b).detach().abs().max()) for a, b in zip(loop_params, ours_params, strict=True))
    # Round-robin after a warm-up, gc off (tools/bench/common/_timing.py), so load changes hit both alike.
    timings = _timing.time_interleaved(
        {"loop": _stepper(loop, device), "stepforge": _stepper(ours, device)}, warmup=warmup, repeats=reps
    )
    t_loop, t_ours = timings["loop"], timings["stepforge"]
    result = {
        "optimizer": name,
        "kwargs": kwargs,
        "loop": t_loop.to_dict(),
        "stepforge": t_ours.to_dict(),
        "ratio": t_loop.median_ms / t_ours.median_ms,
        "ratio_min": t_loop.min_ms / t_ours.min_ms,
        "max_abs_diff_after_one_step": diff,
    }
    del loop_params, ours_params, loop, ours
    return result


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
    parser.add_argument("--reps", type=int, default=7, help="timed steps per optimizer (median reported)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: all usable cores)")
    parser.add_argument(
        "--target", type=float, default=3.0, help="the speed-up each row must reach (its `met` field)"
    )
    parser.add_argument("--out", type=Path, default=Path("bench-out"), help="directory for <stem>.json/.png")
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 20 tensors of at most 200 K elements"
    )
    parser.add_argument("--stem", help="file name stem (default <device>-<date>-optim)")
    args = parser.parse_args(argv)
    threads = _timing.configure_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    results = []
    for case in args.case:
        spec = dict(CASES[case])
        if args.tensors:
            spec["count"] = args.tensors
        if args.max_numel:
            spec["high"] = args.max_numel
        if args.quick:
            spec.update(count=min(spec["count"], 20), high=min(spec["high"], 200_000))
        sizes = sizes_for(**spec)
        for name in args.optimizers:
            r = bench_one(name, sizes, device, dtype, args.reps, args.warmup)
            r.update(
                case=case,
                tensors=len(sizes),
                min_numel=min(sizes),
                max_numel=max(sizes),
                total_numel=sum(sizes),
                dtype=args.dtype,
                target=args.target,
                met=r["ratio"] >= args.target,
            )
            results.append(r)
            print(
                f"{case:>5} {name:<4} {len(sizes)} tensors, {sum(sizes) / 1e6:.1f} M elements: "
                f"loop {r['loop']['median_ms']:8.1f} ms  stepforge {r['stepforge']['median_ms']:8.1f} ms  "
                f"ratio {r['ratio']:.2f}x median / {r['ratio_min']:.2f}x min "
                f"(target {args.target:g}x; max |diff| after 1 step {r['max_abs_diff_after_one_step']:.1e})"
            )
    machine = _machine.machine_info(threads)
    if device.type == "cuda":
        machine["gpu"] = torch.cuda.get_device_name(device)
    report = {
        "benchmark": "stepforge.optim Lamb/Lars vs a per-parameter loop of the same math",
        "date_utc": _machine.utc_now(),
        "device": str(device),
        "machine": machine,
        "load_average_end": _machine.load_average(),
        "results": results,
    }
    date = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d")
    stem = args.stem or f"{device.type}-{date}-optim"
    path = _report.save_json(args.out / f"{stem}.json", report)
    plot_rows = [{**r, "case": f"{r['optimizer']} {r['case']}"} for r in results]
    plot = _report.save_ratio_plot(
        args.out / f"{stem}.png", plot_rows, title="stepforge.optim vs a per-parameter loop of the same math"
    )
    print(f"wrote {path} and {plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
