# SPDX-License-Identifier: Apache-2.0
"""A compiled training step through ``Strategy`` against the same model compiled in a plain torch loop.

The demo's byte GPT (``examples/gpt_demo_model.py``), one process, the same optimizer (torch ``AdamW(fused=True)``),
the same batches and the same accumulation (``--accum`` micro-batches per optimizer step):

    torch_compiled     ``torch.compile(model)``; ``(loss / accum).backward()`` per micro-batch, ``step``, ``zero_grad``
    strategy_compiled  ``Strategy(plugin="single").prepare(model, optim_wrapper=..., compile=True)`` +
                       ``ColossalAIOptimWrapper.update_params`` (its ``forward`` compiled in place)
    torch_eager        the plain loop without compiling (how much compiling buys here)
    strategy_eager     ``Strategy`` without compiling (optional)

Two measurements:

1. **Compile time of the first step**: the first optimizer step (``--accum`` forwards and backwards, the step)
   of each compiled contender, each in a fresh process: ``cold`` with an empty Inductor cache
   (``TORCHINDUCTOR_CACHE_DIR`` a new folder: dynamo, AOTAutograd, Inductor's code generation and the C++
   compiler all run), then ``warm`` in another fresh process on that filled cache (what a second run of the same
   model pays: tracing again, the generated code loaded). ``--rounds`` rounds, the contender order reversed every
   other round.
2. **Steady-state step time**: every contender built side by side in one process, ``--warmup`` untimed steps each
   (the compile), then ``--blocks`` blocks of ``--block-steps`` optimizer steps per contender in ABBA order (the
   order reversed every other block), as ``train/bench_train_interleaved.py`` does, so that the drift of a shared
   machine hits every contender alike. The speed of a contender relative to ``torch_compiled`` is taken per
   adjacent block pair (loop time / contender time: < 1 is slower) and reported as the mean with a 95 % Student-t
   interval and the median, from the wall clock and from the process's CPU time (``time.process_time``). With
   ``--threads 1`` the CPU time is the work the step did, whatever share of the cores a loaded machine left it;
   the wall clock adds the waits. The goal: ``strategy_compiled`` within 3 % of ``torch_compiled``
   (ratio >= 0.97).

The warm-up losses of the two compiled contenders are compared too (same weights, same batches, same graph: they
must agree to float32 rounding), so the timing compares the same computation.

    python tools/bench/compile/bench_compile_train.py                 # -> bench-out/cpu-<date>-compile-train.json/.png
    python tools/bench/compile/bench_compile_train.py --tiny --backend aot_eager --out /tmp/x   # seconds: what CI runs
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tools/: the `bench` package
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))

from gpt_demo_model import ByteGPT, load_corpus, sample_batch

from bench.common import _machine, _report
from bench.train import bench_train
from bench.train.bench_train_interleaved import paired_ratios

__all__ = ["CONTENDERS", "main"]

LR = 3e-4
#: contender -> (through Strategy, compiled)
CONTENDERS: dict[str, tuple[bool, bool]] = {
    "torch_compiled": (False, True),
    "strategy_compiled": (True, True),
    "torch_eager": (False, False),
    "strategy_eager": (True, False),
}
BASELINE = "torch_compiled"
#: what `nox -s bench_smoke` runs (tools/bench/smoke.py); aot_eager: every code path without a minute of Inductor
#: code generation per fresh process
SMOKE_ARGS = ("--tiny", "--backend", "aot_eager", "--out", "{out}")


@dataclass
class Contender:
    """One training setup: ``micro_step(x, y)`` runs a micro-batch (and the optimizer step at the window's end) and
    returns the loss; ``micro_steps`` counts the batches drawn so far (each contender sees the same stream)."""

    micro_step: Callable[[torch.Tensor, torch.Tensor], float]
    micro_steps: int = 0


def _compile_options(args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = {"backend": args.backend}
    if args.mode:
        options["mode"] = args.mode
    return options


def build(name: str, args: argparse.Namespace) -> Contender:
    """Contender ``name`` of :data:`CONTENDERS` on a fresh model (same seed: the same weights for every one)."""
    through_strategy, compiled = CONTENDERS[name]
    torch.manual_seed(0)
    model = ByteGPT(args.d_model, args.layers, args.heads, args.seq_len)
    accum = args.accum

    def loss_of(net: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(net(x).flatten(0, 1).float(), y.flatten())

    if not through_strategy:
        net = torch.compile(model, **_compile_options(args)) if compiled else model
        opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
        count = [0]

        def loop_step(x: torch.Tensor, y: torch.Tensor) -> float:
            loss = loss_of(net, x, y)
            (loss / accum).backward()
            count[0] += 1
            if count[0] % accum == 0:
                opt.step()
                opt.zero_grad(set_to_none=True)
            return float(loss.detach())

        return Contender(loop_step)
    from stepforge.strategy import Strategy

    strategy = Strategy(plugin="single", work_dir=args.work_dir, log_kwargs=dict(console=False))
    wrapped, wrapper = strategy.prepare(
        model,
        optim_wrapper=dict(optimizer=dict(type="AdamW", lr=LR, fused=True), accumulative_counts=accum),
        compile=_compile_options(args) if compiled else False,
        dispatch_kwargs=dict(max_iters=10**9),
    )

    def strategy_step(x: torch.Tensor, y: torch.Tensor) -> float:
        with wrapper.optim_context(wrapped):
            loss = loss_of(wrapped, x, y)
        wrapper.update_params(loss)
        return float(loss.detach())

    return Contender(strategy_step)


def _steps(contender: Contender, steps: int, corpus: torch.Tensor, args: argparse.Namespace) -> list[float]:
    """``steps`` optimizer steps (``accum`` micro-batches each); returns the micro-batch losses."""
    losses = []
    for _ in range(steps * args.accum):
        x, y = sample_batch(corpus, args.seq_len, args.micro_batch, 0, contender.micro_steps, 0)
        contender.micro_steps += 1
        losses.append(contender.micro_step(x, y))
    return losses


def _first_step_worker(
    rank: int, world: int, job: tuple[str, str], args: argparse.Namespace, out: str
) -> None:
    name, cache_dir = job
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir  # read when Inductor first compiles, after this line
    torch.set_num_threads(args.threads)
    corpus = load_corpus(args.corpus_bytes)
    contender = build(name, args)
    t0 = time.perf_counter()
    _steps(contender, 1, corpus, args)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    _steps(contender, 1, corpus, args)
    Path(out, f"rank{rank}.json").write_text(
        json.dumps({"first_s": first, "second_s": time.perf_counter() - t0})
    )


def first_steps(names: list[str], args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    """Per compiled contender: the first step's seconds with a cold and a warm Inductor cache, each in a fresh
    process, and the second step's (already compiled) for scale."""
    found: dict[str, dict[str, list[float]]] = {
        n: {"cold_s": [], "warm_s": [], "second_s": []} for n in names if CONTENDERS[n][1]
    }
    for r in range(args.rounds):
        order = list(found) if r % 2 == 0 else list(found)[::-1]
        for name in order:
            with tempfile.TemporaryDirectory(prefix="inductor-cache-") as cache:
                for temperature in ("cold_s", "warm_s"):
                    (run,) = bench_train.spawn_ranks(_first_step_worker, (name, cache), args)
                    found[name][temperature].append(run["first_s"])
                    found[name]["second_s"].append(run["second_s"])
    return found


def _steady_worker(rank: int, world: int, names: list[str], args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(args.threads)
    corpus = load_corpus(args.corpus_bytes)
    built = {name: build(name, args) for name in names}
    warm = {name: _steps(built[name], args.warmup, corpus, args) for name in names}
    times: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for block in range(args.blocks):
        for name in names if block % 2 == 0 else names[::-1]:
            t0, c0 = time.perf_counter(), time.process_time()
            _steps(built[name], args.block_steps, corpus, args)
            cpu[name].append(time.process_time() - c0)
            times[name].append(time.perf_counter() - t0)
    Path(out, f"rank{rank}.json").write_text(
        json.dumps({"block_s": times, "block_cpu_s": cpu, "warmup_losses": warm})
    )


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_train.add_model_arguments(p)
    p.set_defaults(world=1)
    p.add_argument("--out", default=str(bench_train.ROOT / "bench-out"))
    p.add_argument("--contenders", default="torch_compiled,strategy_compiled,torch_eager")
    p.add_argument("--backend", default="inductor", help="torch.compile backend (both compiled contenders)")
    p.add_argument("--mode", default=None, help="torch.compile mode (default: torch's)")
    p.add_argument(
        "--rounds", type=int, default=2, help="fresh-process first-step measurements per contender"
    )
    p.add_argument("--blocks", type=int, default=16, help="timed blocks per contender")
    p.add_argument("--block-steps", type=int, default=4, help="optimizer steps per block")
    p.add_argument("--warmup", type=int, default=3, help="untimed optimizer steps of each contender first")
    p.add_argument("--name", default="compile-train", help="the results are cpu-<date>-<name>.json/.png")
    args = p.parse_args(argv)
    if args.world != 1:
        p.error("--world: this bench runs one process (plugin 'single'); bench_train*.py cover N ranks")
    if args.tiny:
        bench_train.shrink_to_tiny(args)
        args.rounds, args.blocks, args.block_steps, args.warmup = 1, 2, 1, 1
    if args.threads <= 0:
        args.threads = max(1, os.cpu_count() or 1)
    return args


def _plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    compiled = [r for r in rows if r.get("first_step")]
    for offset, key, colour in ((-0.2, "cold_s", "tab:red"), (0.2, "warm_s", "tab:orange")):
        left.bar([i + offset for i in range(len(compiled))], [statistics.median(r["first_step"][key]) for r in compiled],
                 width=0.4, color=colour, label=f"first step, {key[:-2]} cache (median)")  # fmt: skip
    left.bar([i for i in range(len(compiled))], [statistics.median(r["first_step"]["second_s"]) for r in compiled],
             width=0.15, color="black", label="second step")  # fmt: skip
    left.set_xticks(range(len(compiled)), [r["contender"] for r in compiled])
    left.set_ylabel("seconds")
    left.legend(fontsize=8)
    for i, row in enumerate(rows[1:]):
        for key, style in (("paired", "-"), ("paired_cpu", ":")):
            pr = row[key]
            clock = "wall" if key == "paired" else "CPU"
            right.plot(range(1, len(pr["ratios"]) + 1), pr["ratios"], marker="o", ms=3, lw=0.8, ls=style,
                       color=f"C{i}", label=f"{row['contender']} ({clock}): mean {pr['mean']:.4f} "
                                         f"[{pr['ci95'][0]:.4f}, {pr['ci95'][1]:.4f}]")  # fmt: skip
    right.axhline(1.0, color="black", lw=0.8)
    right.axhline(0.97, color="tab:red", ls="--", lw=0.8, label="0.97 (within 3 %)")
    right.set_xlabel("block pair")
    right.set_ylabel(f"speed relative to {BASELINE}")
    right.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    names = [n.strip() for n in args.contenders.split(",") if n.strip()]
    unknown = sorted(set(names) - set(CONTENDERS))
    if unknown or not names or names[0] != BASELINE or len(set(names)) != len(names) or len(names) < 2:
        raise SystemExit(
            f"--contenders: {BASELINE} first, then distinct names from {list(CONTENDERS)} ({unknown})"
        )
    machine = _machine.machine_info(threads=args.threads)
    first = first_steps(names, args)
    (steady,) = bench_train.spawn_ranks(_steady_worker, names, args)
    block_s, block_cpu_s = steady["block_s"], steady["block_cpu_s"]
    tokens = args.block_steps * args.accum * args.micro_batch * args.seq_len
    rows = []
    for name in names:
        row: dict[str, Any] = {"contender": name, "first_step": first.get(name)}
        row.update(block_s=block_s[name], block_cpu_s=block_cpu_s[name])
        row["step_ms_median"] = 1e3 * statistics.median(block_s[name]) / args.block_steps
        row["step_cpu_ms_median"] = 1e3 * statistics.median(block_cpu_s[name]) / args.block_steps
        row["tokens_per_s_median"] = tokens / statistics.median(block_s[name])
        row["paired"] = paired_ratios(block_s[BASELINE], block_s[name])
        row["paired_cpu"] = paired_ratios(block_cpu_s[BASELINE], block_cpu_s[name])
        rows.append(row)
    base_losses = steady["warmup_losses"][BASELINE]
    agreement = {
        n: max(abs(a - b) / abs(b) for a, b in zip(steady["warmup_losses"][n], base_losses, strict=True))
        for n in names[1:]
    }
    print(f"first optimizer step (s, median of {args.rounds}): cold cache / warm cache / second step")
    for name, f in first.items():
        print(f"  {name:<18} {statistics.median(f['cold_s']):7.2f} / {statistics.median(f['warm_s']):7.2f} / "
              f"{statistics.median(f['second_s']):7.3f}")  # fmt: skip
    print(f"steady state: {args.blocks} blocks x {args.block_steps} steps per contender, ABBA order")
    for row in rows:
        for clock, key, ms in (
            ("wall", "paired", "step_ms_median"),
            ("cpu ", "paired_cpu", "step_cpu_ms_median"),
        ):
            pr = row[key]
            print(f"  {row['contender']:<18} {clock} {row[ms]:8.1f} ms/step  x {BASELINE}: mean {pr['mean']:.4f} "
                  f"95% [{pr['ci95'][0]:.4f}, {pr['ci95'][1]:.4f}]  median {pr['median']:.4f}")  # fmt: skip
    print(f"warm-up losses, largest relative difference to {BASELINE}: {agreement}")
    n_params = sum(
        p.numel() for p in ByteGPT(args.d_model, args.layers, args.heads, args.seq_len).parameters()
    )
    machine["date_utc_end"] = _machine.utc_now()
    machine["load_average_end"] = _machine.load_average()
    machine["stepforge_strategy"] = _version("stepforge-strategy")
    config = {k: v for k, v in vars(args).items() if k not in ("out", "work_dir")}
    stem = f"cpu-{datetime.date.today().isoformat()}-{args.name}{'-tiny' if args.tiny else ''}"
    out = Path(args.out)
    goal = {"strategy_compiled_ratio_at_least": 0.97, "of": BASELINE}
    _report.save_json(out / f"{stem}.json", {"machine": machine, "config": config, "params": n_params,
                                             "goal": goal, "warmup_loss_agreement": agreement, "rows": rows})  # fmt: skip
    title = (f"{n_params / 1e6:.2f} M-param byte GPT, 1 process x {args.threads} threads, accum {args.accum}, "
             f"backend {args.backend}; {machine['cpu'].get('model', '')}; load {machine.get('load_average')}")  # fmt: skip
    _plot(rows, out / f"{stem}.png", title)
    print(f"wrote {out / stem}.json and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
