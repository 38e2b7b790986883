# SPDX-License-Identifier: Apache-2.0
"""CPU benchmark of ``FusedSGD`` against ``torch.optim.SGD(fused=True)`` and ``SGD(foreach=True)``, side by side
in one run (the target ratio is against the fused one).

    python tools/bench/fused/bench_fused_sgd.py                  # full run (~2-4 min on 2 cores)
    python tools/bench/fused/bench_fused_sgd.py --quick          # smaller sizes, 3 repeats: a smoke run
    python tools/bench/fused/bench_fused_sgd.py --threads 2 --repeats 15 --out benchmarks/results/fused-cpu \\
        --stem cpu-2026-11-25-fused-sgd

Cases: one 50M-element tensor, 2 000 x 10 000 and 20 000 x 1 000 tensors, each with momentum 0.9 and without
momentum (weight decay 1e-4, fp32, the same ``p.grad`` tensors every step). Only ``optimizer.step()`` is timed,
contenders round-robin after ``--warmup`` untimed steps (the first step allocates the momentum buffers).

Effective GB/s = minimum bytes an ideal single-pass kernel moves / step time: with momentum 20 B per element
(read p, g, buf; write p, buf), without 12 B (read p, g; write p). The ceiling beside it is the same access
pattern with trivial math (numpy ``buf += g; p += buf`` resp. ``p += g`` on L2-sized chunks of torch-allocated
arrays, one Python thread per core), measured before and after the cases; the higher one is kept.
Results: a table on stdout, ``<out>/<stem>.json`` and ``<out>/<stem>.png`` (see tools/bench/README.md for the layout).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tools/: the `bench` package
from bench.common import _machine, _report, _timing

__all__ = ["main", "sgd_pattern_ceiling"]

#: what `nox -s bench_smoke` runs (tools/bench/smoke.py): seconds, every code path, no timing judged
SMOKE_ARGS = ("--quick", "--no-plot", "--repeats", "1", "--warmup", "0", "--out", "{out}")

BYTES = {True: 20, False: 12}  # per element, with / without a momentum buffer
FULL = ((1, 50_000_000), (2_000, 10_000), (20_000, 1_000))
QUICK = ((1, 4_000_000), (200, 10_000), (2_000, 1_000))
TARGETS = (1.0, 1.0, 2.0)  # per shape above, with and without momentum
HP = dict(lr=0.01, weight_decay=1e-4)


def _label(count: int, numel: int) -> str:
    for unit, div in (("M", 1_000_000), ("k", 1_000)):
        if numel % div == 0:
            return f"{count}x{numel // div}{unit}"
    return f"{count}x{numel}"


def sgd_pattern_ceiling(n: int, momentum: bool, *, threads: int, repeats: int = 5) -> dict[str, Any]:
    """GB/s of SGD's access pattern with trivial math: the ceiling a memory-bound SGD kernel can reach.

    With momentum ``buf += g; p += buf`` (DRAM: read p, g, buf, write p, buf = 20 B per element), without
    ``p += g`` (12 B), chunk by chunk (the second touch hits L2), one Python thread per core on its own slice.
    """
    import numpy as np

    gen = torch.Generator().manual_seed(0)
    p, g, b = (torch.randn(n, generator=gen).mul_(1e-3).numpy() for _ in range(3))

    def work(lo: int, hi: int, chunk: int) -> None:
        for s in range(lo, hi, chunk):
            e = min(hi, s + chunk)
            if momentum:
                np.add(b[s:e], g[s:e], out=b[s:e])
                np.add(p[s:e], b[s:e], out=p[s:e])
            else:
                np.add(p[s:e], g[s:e], out=p[s:e])

    step = -(-n // threads)
    by_chunk: dict[str, float] = {}
    with ThreadPoolExecutor(max_workers=threads) as pool:
        for chunk in (32_768, 131_072):

            def run(chunk: int = chunk) -> None:
                for f in [pool.submit(work, lo, min(n, lo + step), chunk) for lo in range(0, n, step)]:
                    f.result()

            by_chunk[str(chunk)] = _timing.time_interleaved({"x": run}, warmup=1, repeats=repeats)[
                "x"
            ].median_ms
    ms = min(by_chunk.values())
    return {
        "gb_per_s": BYTES[momentum] * n / (ms * 1e-3) / 1e9,
        "ms": ms,
        "elements": n,
        "bytes_per_element": BYTES[momentum],
        "threads": threads,
        "by_chunk_ms": by_chunk,
    }


def _make(count: int, numel: int, seed: int) -> list[torch.nn.Parameter]:
    """``count`` separately allocated params with grads; the same values for every call with the same seed."""
    gen = torch.Generator().manual_seed(seed)
    init = torch.randn(numel, generator=gen)
    grad = torch.randn(numel, generator=gen).mul_(1e-2)
    params = []
    for i in range(count):
        p = torch.nn.Parameter(init.roll(i % numel))
        p.grad = grad.roll(i % numel)
        params.append(p)
    return params


def _import_fused() -> tuple[Any, str | None]:
    try:
        import stepforge.fused as fused
    except Exception as exc:  # the torch column still runs and the JSON says why ours is missing
        return None, f"{type(exc).__name__}: {exc}"
    return fused, None


def run_case(
    count: int, numel: int, momentum: bool, args: argparse.Namespace, fused: Any, ceiling: dict[bool, float]
) -> dict[str, Any]:
    hp = dict(HP, momentum=0.9 if momentum else 0.0)
    fns: dict[str, Callable[[], Any]] = {}
    ref_params = _make(count, numel, args.seed)
    fns["torch"] = torch.optim.SGD(ref_params, fused=True, **hp).step
    fns["torch_foreach"] = torch.optim.SGD(_make(count, numel, args.seed), foreach=True, **hp).step
    ours_params: list[torch.nn.Parameter] = []
    if fused is not None:
        ours_params = _make(count, numel, args.seed)
        fns["ours"] = fused.FusedSGD(ours_params, **hp).step
    t = _timing.time_interleaved(fns, warmup=args.warmup, repeats=args.repeats)
    total = count * numel
    row: dict[str, Any] = {
        "case": f"FusedSGD vs SGD(fused) {_label(count, numel)} {'momentum 0.9' if momentum else 'no momentum'}",
        "shape": [count, numel],
        "momentum": hp["momentum"],
        "torch_ms": t["torch"].median_ms,
        "foreach_ms": t["torch_foreach"].median_ms,
        "baseline_gb_per_s": BYTES[momentum] * total / (t["torch"].median_ms * 1e-3) / 1e9,
        "samples": {k: v.to_dict() for k, v in t.items()},
    }
    if "ours" in t:
        ours = t["ours"]
        row |= {
            "ours_ms": ours.median_ms,
            "ratio": t["torch"].median_ms / ours.median_ms,
            "ratio_min": t["torch"].min_ms / ours.min_ms,
            "ratio_foreach": t["torch_foreach"].median_ms / ours.median_ms,
            "gb_per_s": BYTES[momentum] * total / (ours.median_ms * 1e-3) / 1e9,
            "best_gb_per_s": BYTES[momentum] * total / (ours.min_ms * 1e-3) / 1e9,
        }
        row["pct_of_ceiling"] = 100.0 * row["best_gb_per_s"] / ceiling[momentum]
        # same start, grads and step count: without momentum equal at any size; with it, where torch's vector
        # body covers the tensor (its scalar tail rounds buf*m + g*(1-d) differently, see stepforge-fused's tests/optimizers/test_sgd_bits.py)
        pairs = zip(ours_params, ref_params, strict=True)
        row["bit_identical_to_torch_fused"] = all(torch.equal(a, b) for a, b in pairs)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes, 3 repeats (smoke run)")
    ap.add_argument("--threads", type=int, default=None, help="torch/OpenMP threads (default: usable cores)")
    ap.add_argument(
        "--repeats", type=int, default=None, help="timed steps per contender (default 10; quick 3)"
    )
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench-out")
    ap.add_argument("--stem", default=None, help="file name stem (default cpu-<date>-fused-sgd[-quick])")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    args.repeats = args.repeats or (3 if args.quick else 10)
    threads = _timing.configure_threads(args.threads)
    shapes = QUICK if args.quick else FULL
    fused, err = _import_fused()
    t0 = time.perf_counter()
    machine = _machine.machine_info(threads)
    if fused is not None:
        machine["stepforge_cpu_features"] = fused.cpu_features()
    ceil_n = shapes[0][1]

    def ceilings() -> dict[bool, dict[str, Any]]:
        return {
            m: sgd_pattern_ceiling(ceil_n, m, threads=threads, repeats=args.repeats // 2 + 1)
            for m in (True, False)
        }

    before = ceilings()
    rows = []
    for (count, numel), target in zip(shapes, TARGETS, strict=True):
        for momentum in (True, False):
            gbs = {m: before[m]["gb_per_s"] for m in (True, False)}
            row = run_case(count, numel, momentum, args, fused, gbs)
            row["target"] = target
            row["met"] = row.get("ratio") is not None and row["ratio"] >= target
            rows.append(row)
            print(
                f"  {row['case']}: ratio {row.get('ratio', float('nan')):.2f}x "
                f"(vs foreach {row.get('ratio_foreach', float('nan')):.2f}x)",
                flush=True,
            )
    after = ceilings()
    ceiling = {m: max(before[m]["gb_per_s"], after[m]["gb_per_s"]) for m in (True, False)}
    for row in rows:  # against the higher (final) ceiling
        if "best_gb_per_s" in row:
            row["pct_of_ceiling"] = 100.0 * row["best_gb_per_s"] / ceiling[row["momentum"] != 0.0]
        row["ceiling_gb_per_s"] = ceiling[row["momentum"] != 0.0]
    columns = [
        ("case", "case", ""),
        ("ours_ms", "ours ms", ".2f"),
        ("torch_ms", "torch ms", ".2f"),
        ("ratio", "ratio", ".2f"),
        ("ratio_min", "ratio(min)", ".2f"),
        ("foreach_ms", "foreach ms", ".2f"),
        ("ratio_foreach", "vs foreach", ".2f"),
        ("target", "target", ".1f"),
        ("gb_per_s", "GB/s", ".1f"),
        ("baseline_gb_per_s", "torch GB/s", ".1f"),
        ("ceiling_gb_per_s", "ceiling", ".1f"),
        ("pct_of_ceiling", "% ceil(best)", ".0f"),
    ]
    print(_report.format_table(rows, columns))
    load_end = _machine.load_average()
    print(
        f"threads {threads}, ISA {machine.get('stepforge_cpu_features', {}).get('isa')}, torch {torch.__version__}, "
        f"load average {machine['load_average']} -> {load_end}"
    )
    if err:
        print(f"stepforge-fused not importable: {err}")
    stem = args.stem or f"cpu-{machine['date_utc'][:10]}-fused-sgd{'-quick' if args.quick else ''}"
    out = Path(args.out)
    payload = {
        "schema": "stepforge-bench/1",
        "date_utc": machine["date_utc"],
        "device": machine["device"],
        "machine": machine,
        "load_average_end": load_end,
        "config": {"shapes": shapes, "threads": threads, "repeats": args.repeats, "warmup": args.warmup,
                   "hp": HP, "momentum": [0.9, 0.0], "bytes_per_element": {"momentum": 20, "no_momentum": 12},
                   "quick": args.quick},
        "ceiling": {"momentum": {"before": before[True], "after": after[True]},
                    "no_momentum": {"before": before[False], "after": after[False]}},
        "rows": rows,
        "import_error": err,
        "wall_s": time.perf_counter() - t0,
    }  # fmt: skip
    print("wrote", _report.save_json(out / f"{stem}.json", payload))
    if not args.no_plot:
        title = f"FusedSGD vs torch.optim.SGD(fused=True), {threads} threads, load {machine['load_average'][0]:.1f}"
        print(
            "wrote",
            _report.save_ratio_plot(out / f"{stem}.png", rows, title=title, ceiling_gb_per_s=ceiling[True]),
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
