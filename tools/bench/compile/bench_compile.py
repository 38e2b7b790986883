# SPDX-License-Identifier: Apache-2.0
"""torch.compile of optimizer steps: stepforge's optimizers against torch's AdamW(foreach) and AdamW(fused).

    python tools/bench/compile/bench_compile.py                       # CPU (+ CUDA if present): GPT-2 small, demo GPT
    python tools/bench/compile/bench_compile.py --models demo --optimizers FusedAdam,AdamW(fused) --repeats 20
    python tools/bench/compile/bench_compile.py --device cuda         # only CUDA: mode="reduce-overhead" (CUDA graphs)
    python tools/bench/compile/bench_compile.py --tiny --no-plot      # seconds: every code path once (CI smoke)

For every parameter list (``gpt2``: GPT-2 small's 148 tensors, 124M parameters, fp32; ``demo``: the byte GPT of
``examples/train_gpt_demo.py``, 0.39M parameters) and every optimizer, eager and compiled the same way
(``torch.compile(opt.step, fullgraph=True)``; torch's optimizers break the graph on purpose around their update
(``_use_grad_for_differentiable``), so where dynamo refuses ``fullgraph=True`` the step is compiled without it, as
torch's compiled-optimizer recipe does; on CUDA ``mode="reduce-overhead"``, the step replayed as a CUDA
graph; a tensor learning rate, as the compiled-optimizer recipe has it):

- ``first step s``: the first call -- for a compiled step dynamo + inductor + that step, with a cold on-disk
  inductor cache (a fresh ``TORCHINDUCTOR_CACHE_DIR`` per contender unless ``--warm-cache``; the one-time start-up
  of the compiler is taken by a trivial compile first and reported apart); for an eager step the state creation;
- steady-state ``ms`` per step: median of ``--repeats`` after ``--warmup``, pooled over ``--rounds`` rounds. Each
  optimizer is timed in a group of three built side by side and stepped round-robin (A, B, C, A, ...): its eager
  step, its compiled step, and a compiled torch AdamW(fused) as the group's reference (torch's own optimizers form
  groups of two; GPT-2 small's Adam state is 1 GB, so one group lives at a time; every round rebuilds and
  recompiles them);
- ``x fused-c``: the group's compiled AdamW(fused) time / this row's time, median over the rounds (torch's rows:
  against the AdamW(fused) group's; >= 1: at least as fast; the goal for the compiled stepforge steps is >= 1.0);
- graph breaks and graphs of the compiled step, and the peak transient allocation of one steady-state step
  (CPU: the allocator's records via the torch profiler; CUDA: max_memory_allocated).

All contenders share one parameter list and one set of gradients (reused every step). Results, per device (the
CUDA cases run when torch sees a device): a table, ``<out>/<device>-<date>-compile.json`` (device, versions,
date) and the PNG beside it.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# inductor compiles in this process: its pool of compile workers would compete for the cores being timed
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
if "--warm-cache" not in sys.argv and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    # a cold inductor cache, so the first step's time is a real compile time (set before torch is imported)
    _first_cache = tempfile.mkdtemp(prefix="bench-compile-inductor-")
    atexit.register(shutil.rmtree, _first_cache, True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _first_cache

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tools/: the `bench` package
from bench.common import _machine, _report, _timing
from bench.compile._cases import (
    CONTENDERS,
    Result,
    demo_shapes,
    gpt2_small_shapes,
    measure_group,
    tiny_shapes,
    warm_up_compiler,
)

__all__ = ["main"]

MODELS = {"gpt2": gpt2_small_shapes, "demo": demo_shapes, "tiny": tiny_shapes}
DEFAULT_OPTIMIZERS = "FusedAdam,CPUAdam,FusedLAMB,Lamb,AdamW(foreach),AdamW(fused)"
BASELINE = "AdamW(fused)"
#: what `nox -s bench_smoke` runs (tools/bench/smoke.py): one stepforge-fused and one stepforge-optim step eager
#: and compiled, beside the AdamW(fused) baseline
SMOKE_ARGS = ("--tiny", "--optimizers", "FusedAdam,Lars", "--out", "{out}")
COLUMNS = [
    ("model", "model", ""),
    ("optimizer", "optimizer", ""),
    ("mode", "mode", ""),
    ("first_step_s", "first step s", ".2f"),
    ("median_ms", "ms/step", ".3f"),
    ("vs_fused_compiled", "x fused-c", ".2f"),
    ("fullgraph", "fullgraph", ""),
    ("graph_breaks", "breaks", ""),
    ("graphs", "graphs", ""),
    ("peak_extra_mb", "extra MB", ".3f"),
    ("error", "error", ""),
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--models", default="gpt2,demo", help="comma list of gpt2, demo, tiny (default gpt2,demo)")
    p.add_argument("--optimizers", default=DEFAULT_OPTIMIZERS, help=f"comma list of {', '.join(CONTENDERS)}")
    p.add_argument(
        "--device",
        default="all",
        help="cpu, cuda, or all (default: the CPU, and CUDA when torch sees a device)",
    )
    p.add_argument("--threads", type=int, default=0, help="intra-op threads (default: all usable cores)")
    p.add_argument("--repeats", type=int, default=10, help="timed steps per contender and round (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after the first (default 2)")
    p.add_argument("--rounds", type=int, default=2, help="rebuild-and-time rounds (default 2)")
    p.add_argument(
        "--tiny", action="store_true", help="the tiny parameter list, 1 round, 2 repeats (CI smoke)"
    )
    p.add_argument("--warm-cache", action="store_true", help="keep inductor's cache (compile times then lie)")
    p.add_argument("--out", default="bench-out", help="output folder for JSON + PNG (default bench-out/)")
    p.add_argument("--stem", default=None, help="output file stem (default <device>-<date>-compile)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    return p


def _params(shapes: list[tuple[int, ...]], device: torch.device, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter((torch.randn(shape, generator=gen) * 0.02).to(device))
        p.grad = (torch.randn(shape, generator=gen) * 1e-3).to(device)
        params.append(p)
    return params


def _rows(results: list[Result]) -> list[dict[str, Any]]:
    """One row per (model, optimizer, mode), samples pooled over the rounds; ``vs_fused_compiled`` is the
    median over the rounds of (the group's compiled AdamW(fused) median / this contender's median)."""
    pooled: dict[tuple[str, str, str], list[Result]] = {}
    references: dict[tuple[str, str, int], Result] = {}
    index: dict[int, int] = {}
    for r in results:
        if r.reference_for is not None:
            references[(r.model, r.reference_for, index.setdefault(id(r), len(references)))] = r
            continue
        pooled.setdefault((r.model, r.optimizer, r.mode), []).append(r)
    by_group: dict[tuple[str, str], list[Result]] = {}
    for (model, name, _n), ref in references.items():
        by_group.setdefault((model, name), []).append(ref)
    rows = []
    for (model, optimizer, mode), runs in pooled.items():
        refs = by_group.get((model, optimizer), [])
        if not refs:  # torch's rows: the baseline's own compiled runs, round by round (other groups: noisier)
            refs = list(pooled.get((model, BASELINE, "compiled"), []))
        ratios = [ref.median_ms / run.median_ms for ref, run in zip(refs, runs, strict=False)
                  if ref.samples_ms and run.samples_ms]  # fmt: skip
        first = runs[0]
        samples = [s for run in runs for s in run.samples_ms]
        rows.append({
            "model": model, "optimizer": optimizer, "family": first.family, "mode": mode,
            "first_step_s": first.first_step_s, "median_ms": statistics.median(samples) if samples else float("nan"),
            "samples_ms": samples, "vs_fused_compiled": statistics.median(ratios) if ratios else float("nan"),
            "reference_ms": [ref.median_ms for ref in refs],
            "graph_breaks": first.graph_breaks if mode == "compiled" else None,
            "graphs": first.graphs if mode == "compiled" else None, "fullgraph": first.fullgraph,
            "peak_extra_mb": max(run.peak_extra_mb for run in runs), "error": next((r.error for r in runs if r.error), None),
        })  # fmt: skip
    return rows


def _plot(path: Path, rows: list[dict[str, Any]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(len(models), 2, figsize=(13, 3.2 * len(models) + 0.8), squeeze=False)
    for (ax_t, ax_c), model in zip(axes, models, strict=True):
        mine = [r for r in rows if r["model"] == model]
        names = list(dict.fromkeys(r["optimizer"] for r in mine))
        y = list(range(len(names)))
        for offset, mode, color in ((-0.2, "eager", "tab:gray"), (0.2, "compiled", "tab:blue")):
            by = {r["optimizer"]: r for r in mine if r["mode"] == mode}
            values = [by[n]["median_ms"] if n in by else 0.0 for n in names]
            ax_t.barh([v + offset for v in y], values, height=0.4, color=color, label=mode)
            if mode == "compiled":
                firsts = [by[n]["first_step_s"] if n in by else 0.0 for n in names]
                ax_c.barh(y, firsts, height=0.6, color=color)
        ax_t.set_yticks(y, names, fontsize=8)
        ax_t.invert_yaxis()
        ax_t.set_xlabel(f"{model}: ms per step (median; lower is better)")
        ax_t.legend(fontsize=8)
        ax_c.set_yticks(y, names, fontsize=8)
        ax_c.invert_yaxis()
        ax_c.set_xlabel(f"{model}: compiled first step, s (dynamo + inductor, cold cache)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _devices(choice: str) -> list[torch.device]:
    """``cpu``, ``cuda``, or ``all``: the CPU, and CUDA when torch sees a device (the CUDA cases' device check)."""
    if choice == "all":
        return [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    if choice not in ("cpu", "cuda"):
        raise SystemExit(f"--device: {choice!r}; choose cpu, cuda or all")
    if choice == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    return [torch.device(choice)]


def run_device(device: torch.device, args: argparse.Namespace, optimizers: list[str], threads: int) -> Path:
    """Every model and optimizer on ``device``; writes ``<out>/<stem>.json`` (and the PNG); returns the JSON."""
    compile_mode = "reduce-overhead" if device.type == "cuda" else None
    machine = _machine.machine_info(threads)
    print(
        f"{machine['device']}, {threads} threads, torch {torch.__version__}, {device}, load {machine['load_average']}"
    )
    started = time.perf_counter()
    startup_s = warm_up_compiler(device)
    print(f"compiler start-up (first trivial compile, not charged to any contender): {startup_s:.1f} s")
    results: list[Result] = []
    for model in [m.strip() for m in args.models.split(",") if m.strip()]:
        if model not in MODELS:
            raise SystemExit(f"--models: unknown {model!r}; choose from {', '.join(MODELS)}")
        params = _params(MODELS[model](), device)
        print(f"[{model}] {len(params)} tensors, {sum(p.numel() for p in params) / 1e6:.2f}M parameters")
        for rnd in range(args.rounds):
            for name in optimizers:
                # one group per optimizer: its eager and compiled steps beside the compiled baseline, round-robin
                group = [Result(model, name, CONTENDERS[name][0], mode) for mode in ("eager", "compiled")]
                if CONTENDERS[name][0] == "stepforge":
                    # (not beside torch's foreach AdamW: a second AdamW compiled in one dynamo session breaks it)
                    group.append(Result(model, BASELINE, "torch", "compiled", reference_for=name))
                measure_group(group, params, device=device, warmup=args.warmup, repeats=args.repeats,
                              compile_mode=compile_mode, cold_cache=not args.warm_cache and rnd == 0)  # fmt: skip
                for r in group:
                    if rnd > 0:
                        r.first_step_s = float("nan")  # warm caches after round 0: not a compile time
                    results.append(r)
                    note = r.error or f"{r.median_ms:.3f} ms/step, first {r.first_step_s:.2f} s"
                    ref = f" (reference for {r.reference_for})" if r.reference_for else ""
                    print(f"  round {rnd} {r.optimizer:15s} {r.mode:8s} {note}{ref}", flush=True)
        del params
    rows = _rows(results)
    print(_report.format_table(rows, COLUMNS))
    date = machine["date_utc"][:10]
    stem = args.stem or f"{device.type}-{date}-compile{'-tiny' if args.tiny else ''}"
    if args.stem and device.type != "cpu":
        stem = f"{args.stem}-{device.type}"
    report = {
        "benchmark": "bench_compile",
        "machine": machine,
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "compile": {
            "fullgraph": "True where dynamo accepts it (see each row's fullgraph)",
            "mode": compile_mode,
            "cold_inductor_cache": not args.warm_cache,
            "compiler_startup_s": startup_s,
        },
        "args": vars(args),
        "baseline": f"{BASELINE} compiled",
        "rows": rows,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    path = _report.save_json(Path(args.out) / f"{stem}.json", report)
    print(f"wrote {path}")
    if not args.no_plot:
        png = Path(args.out) / f"{stem}.png"
        _plot(png, rows, f"torch.compile(opt.step) on {report['device']}, torch {torch.__version__}, {date}")
        print(f"wrote {png}")
    return path


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.tiny:
        args.models, args.rounds, args.repeats, args.warmup = "tiny", 1, 2, 1
    devices = _devices(args.device)
    optimizers = [o.strip() for o in args.optimizers.split(",") if o.strip()]
    unknown = [o for o in optimizers if o not in CONTENDERS]
    if unknown:
        raise SystemExit(f"--optimizers: unknown {unknown}; choose from {', '.join(CONTENDERS)}")
    if BASELINE not in optimizers:
        optimizers.append(BASELINE)
    # several optimizer instances of one class are compiled side by side (a group and its reference): shapes are
    # static, so a second instance must not turn them dynamic (torch's foreach AdamW fails on dynamic shapes)
    torch._dynamo.config.automatic_dynamic_shapes = False
    threads = _timing.configure_threads(args.threads)
    for device in devices:
        run_device(device, args, optimizers, threads)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
