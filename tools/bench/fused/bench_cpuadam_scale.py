# SPDX-License-Identifier: Apache-2.0
"""``CPUAdam`` on all the host's cores against ``torch.optim.AdamW`` (``foreach=True`` and ``fused=True``) on the CPU
at a model's size: ``--numel`` fp32 parameters (default 1 B, DeepSpeed ZeRO-Offload's CPU-Adam comparison), laid out
as a 1.3 B GPT's tensors (``--layout gpt``: its blocks' weight and bias shapes repeated until ``--numel``, the last
one cut to fit) or as one tensor (``--layout flat``). The goal of the offload work: ``CPUAdam`` >= 5x ``foreach``.

Every contender owns its parameters and Adam state (12 B per element); the gradients (4 B per element) are one
set shared by all, read-only, so the memory needed is ``(12 x contenders + 4) x numel`` bytes (40 GB at 1 B with
the three defaults); the bench refuses a size that needs more than 85 % of the machine's available memory, naming
the size that fits. Only ``step()`` is timed, round-robin after ``--warmup`` steps (``_timing.time_interleaved``).
Effective GB/s counts the 28 B per element an ideal single-pass kernel moves.

    python tools/bench/fused/bench_cpuadam_scale.py --out $OUT                    # 1 B, all cores
    python tools/bench/fused/bench_cpuadam_scale.py --numel 100000000 --threads 2 --contenders cpuadam,torch_foreach
    python tools/bench/fused/bench_cpuadam_scale.py --tiny --out /tmp/x           # seconds; what CI runs

Writes ``<out>/<stem>.json`` and ``.png`` (``--stem``, default ``cpuadam-<numel>``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tools/: the `bench` package
from bench.common import _machine, _report, _timing

__all__ = ["gpt_layout", "main"]

#: what `nox -s bench_smoke` runs (tools/bench/smoke.py): seconds, every code path, no timing judged
SMOKE_ARGS = ("--tiny", "--out", "{out}")

HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
BYTES_PER_ELEMENT = 28  # read p, g, m, v; write p, m, v (fp32)
#: contender -> what it is; ``cpuadam`` (first) is compared with each of the others
CONTENDERS: dict[str, str] = {
    "cpuadam": "stepforge CPUAdam (adamw_mode=True)",
    "torch_foreach": "torch.optim.AdamW(foreach=True)",
    "torch_fused": "torch.optim.AdamW(fused=True)",
    "torch_forloop": "torch.optim.AdamW(foreach=False, fused=False)",
}
TARGETS = {"torch_foreach": 5.0}


def gpt_layout(numel: int, d_model: int) -> list[int]:
    """Element counts of a GPT's block tensors (LayerNorm, QKV, projection, MLP; weights and biases) of width
    ``d_model``, repeated until they hold ``numel`` elements, the last one cut to fit."""
    d = d_model
    block = [d, d, 3 * d * d, 3 * d, d * d, d, d, d, 4 * d * d, 4 * d, 4 * d * d, d]
    sizes: list[int] = []
    total = 0
    while total < numel:
        for n in block:
            n = min(n, numel - total)
            if n <= 0:
                break
            sizes.append(n)
            total += n
    return sizes


def _build(name: str, params: list[torch.Tensor], threads: int) -> torch.optim.Optimizer:
    if name == "cpuadam":
        from stepforge.fused import CPUAdam

        return CPUAdam(params, adamw_mode=True, **HP)
    options = {
        "torch_foreach": dict(foreach=True),
        "torch_fused": dict(fused=True),
        "torch_forloop": dict(foreach=False, fused=False),
    }[name]
    return torch.optim.AdamW(params, **HP, **options)


def _fill(sizes: list[int], lo: float, hi: float) -> list[torch.Tensor]:
    # linspace is cheap at 1 B elements where a random fill is not; the values only need to be ordinary floats
    return [torch.linspace(lo, hi, n) for n in sizes]


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=1_000_000_000, help="fp32 parameters in all")
    p.add_argument("--layout", default="gpt", choices=("gpt", "flat"))
    p.add_argument("--d-model", type=int, default=2048, help="the GPT layout's width")
    p.add_argument(
        "--contenders", default="cpuadam,torch_foreach,torch_fused", help=f"from {list(CONTENDERS)}"
    )
    p.add_argument("--threads", type=int, default=0, help="intra-op threads (0: every usable core)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--tiny", action="store_true", help="a seconds-long run that only checks the bench works")
    p.add_argument("--out", default="bench-out")
    p.add_argument("--stem", default="", help="default cpuadam-<numel>")
    args = p.parse_args(argv)
    if args.tiny:
        args.numel, args.d_model, args.repeats, args.warmup = 200_000, 64, 2, 1
        args.contenders = ",".join(CONTENDERS)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    names = [n for n in args.contenders.split(",") if n]
    if not names or names[0] != "cpuadam" or sorted(set(names) - set(CONTENDERS)):
        raise SystemExit(f"--contenders: cpuadam first, then any of {list(CONTENDERS)[1:]}")
    needed = (12 * len(names) + 4) * args.numel
    available = _machine.available_memory_bytes()
    if available is not None and needed > 0.85 * available:
        fits = int(0.85 * available / (12 * len(names) + 4))
        raise SystemExit(
            f"--numel {args.numel}: needs {needed / 2**30:.1f} GiB with {len(names)} contenders, "
            f"{available / 2**30:.1f} GiB available; --numel {fits} fits"
        )
    threads = _timing.configure_threads(args.threads)
    machine = _machine.machine_info(threads)  # before the run: its load average is the one at the start
    sizes = gpt_layout(args.numel, args.d_model) if args.layout == "gpt" else [args.numel]
    grads = _fill(sizes, -1e-2, 1e-2)
    steps: dict[str, Callable[[], Any]] = {}
    keep = []
    for name in names:
        params = [torch.nn.Parameter(t) for t in _fill(sizes, -0.5, 0.5)]
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        opt = _build(name, params, threads)
        keep.append((params, opt))
        steps[name] = opt.step
    timing = _timing.time_interleaved(steps, warmup=args.warmup, repeats=args.repeats)
    ours = timing["cpuadam"]
    gbs = {n: BYTES_PER_ELEMENT * args.numel / (t.median_ms * 1e-3) / 1e9 for n, t in timing.items()}
    rows = []
    for name in names[1:]:
        ratio = timing[name].median_ms / ours.median_ms
        target = TARGETS.get(name)
        rows.append(
            {
                "case": f"CPUAdam vs {name} ({len(sizes)} tensors, {args.numel / 1e9:g} B)",
                "contender": name,
                "ours_ms": ours.median_ms,
                "torch_ms": timing[name].median_ms,
                "ratio": ratio,
                "ratio_min": timing[name].min_ms / ours.min_ms,
                "target": target,
                "met": None if target is None else ratio >= target,
                "gb_per_s": gbs["cpuadam"],
                "baseline_gb_per_s": gbs[name],
            }
        )
    config = {k: v for k, v in vars(args).items() if k != "out"} | {"tensors": len(sizes), "threads": threads}
    out = Path(args.out)
    stem = args.stem or f"cpuadam-{args.numel}"
    path = _report.save_json(
        out / f"{stem}.json",
        {
            "machine": machine,
            "config": config,
            "rows": rows,
            "timing": timing,
            "load_average_end": _machine.load_average(),
        },
    )
    for name, t in timing.items():
        print(f"  {name:<14} {t.median_ms:10.1f} ms/step  {gbs[name]:6.1f} GB/s  ({CONTENDERS[name]})")
    print(
        _report.format_table(
            rows,
            [
                ("case", "case", "s"),
                ("ratio", "CPUAdam speed-up", ".2f"),
                ("target", "target", ""),
                ("met", "met", ""),
            ],
        )
    )
    _report.save_ratio_plot(
        out / f"{stem}.png",
        rows,
        title=f"CPUAdam vs torch AdamW on the CPU, {args.numel / 1e9:g} B fp32, {threads} threads; {machine['device']}",
    )
    print(f"wrote {path} and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
