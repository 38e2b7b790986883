# SPDX-License-Identifier: Apache-2.0
"""End to end, paired at the block level: bench_train's contenders built side by side in the same N gloo
processes and run in alternating blocks of optimizer steps, so that a slow drift of a shared machine hits every
contender alike.

``bench_train.py`` starts fresh processes per contender and run; on a shared 2-core machine one run's tokens/s
moves by 2-10 % from one minute to the next, which hides differences below a few percent even over 9 rounds.
Here every rank builds every contender once (same weights, same data stream per contender), runs ``--warmup``
untimed steps of each, then ``--blocks`` times, for each contender in turn (the order reversed every other block:
ABBA), ``--block-steps`` optimizer steps between two barriers. A block's time therefore holds everything its
steps cost, its communication included; a ZeRO contender's parameter gather is finished inside its own block
(``wait_for_param_gather``, its time kept per block as ``finish_s``), so no work of one contender runs in another's
block; that one gather per block is waited rather than overlapped with a forward, a cost a long run does not pay
at every ``--block-steps`` steps, hence the default of 8. The ratio of a contender to
``torch_loop`` is taken per block pair (adjacent in time), and reported as the mean with a 95 % interval
(Student t) beside the median; the JSON keeps every block time.

Peak memory is not measured here (every contender lives in the same process): ``bench_train.py`` measures it.

    python tools/bench/train/bench_train_interleaved.py                    # -> bench-out/cpu-<date>-train-interleaved.*
    python tools/bench/train/bench_train_interleaved.py --tiny --out /tmp/x  # seconds; what CI runs to keep it working
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tools/: the `bench` package
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))

from gpt_demo_model import load_corpus, sample_batch

from bench.common._spawn import leave_process_group
from bench.train import bench_train

__all__ = ["main", "paired_ratios"]

#: what `nox -s bench_smoke` runs (tools/bench/smoke.py): seconds, every code path, no timing judged
SMOKE_ARGS = ("--tiny", "--out", "{out}")

#: two-sided 95 % Student t quantiles by degrees of freedom (beyond the table: the normal's 1.96)
_T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23,
        12: 2.18, 15: 2.13, 20: 2.09, 25: 2.06, 30: 2.04, 40: 2.02, 60: 2.00, 120: 1.98}  # fmt: skip


def _t95(dof: int) -> float:
    keys = [k for k in _T95 if k <= dof]
    return _T95[max(keys)] if dof <= 120 else 1.96


def paired_ratios(loop_s: list[float], other_s: list[float]) -> dict[str, Any]:
    """Speed of ``other`` relative to the loop per block pair (loop time / other time: > 1 is faster), with the
    mean, its 95 % interval and the median. Needs at least two pairs."""
    ratios = [a / b for a, b in zip(loop_s, other_s, strict=True)]
    mean = statistics.fmean(ratios)
    half = _t95(len(ratios) - 1) * statistics.stdev(ratios) / math.sqrt(len(ratios))
    return {
        "ratios": ratios,
        "mean": mean,
        "ci95": [mean - half, mean + half],
        "median": statistics.median(ratios),
    }


def _worker(rank: int, world: int, names: list[str], args: argparse.Namespace, out: str) -> None:
    cores = bench_train.pin_rank(rank, args.cores_per_rank)
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    corpus = load_corpus(args.corpus_bytes)
    built = {name: bench_train.build(name, args) for name in names}
    micro_steps = dict.fromkeys(names, 0)

    def run(name: str, steps: int) -> float:
        """``steps`` optimizer steps of contender ``name``; returns how long finishing its last one took."""
        contender = built[name]
        plain = bench_train.CONTENDERS[name][0] is None
        for _ in range(steps):
            for m in range(args.accum):
                last = m == args.accum - 1
                x, y = sample_batch(corpus, args.seq_len, args.micro_batch, 0, micro_steps[name], rank)
                micro_steps[name] += 1
                # the torch loop skips DDP's all-reduce inside the window by hand; the wrapper decides it itself
                with contender.no_sync() if (not plain or not last) else nullcontext():
                    loss = F.cross_entropy(contender.model(x).flatten(0, 1).float(), y.flatten())
                    contender.backward(loss)
            contender.step()
        t0 = time.perf_counter()
        contender.finish()
        return time.perf_counter() - t0

    for name in names:
        run(name, args.warmup)
    times: dict[str, list[float]] = {n: [] for n in names}
    finish: dict[str, list[float]] = {n: [] for n in names}
    for block in range(args.blocks):
        for name in names if block % 2 == 0 else names[::-1]:
            dist.barrier()
            t0 = time.perf_counter()
            finish[name].append(run(name, args.block_steps))
            dist.barrier()
            times[name].append(time.perf_counter() - t0)
    Path(out, f"rank{rank}.json").write_text(
        json.dumps({"block_s": times, "finish_s": finish, "cores": cores})
    )
    built.clear()  # what holds the group (DDP, the Strategies), before it goes
    leave_process_group()


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_train.add_model_arguments(p)
    p.add_argument("--out", default=str(bench_train.ROOT / "bench-out"))
    p.add_argument("--blocks", type=int, default=16, help="timed blocks per contender")
    p.add_argument(
        "--block-steps",
        type=int,
        default=8,
        help="optimizer steps per block (the last one's gather is waited)",
    )
    p.add_argument("--warmup", type=int, default=2, help="untimed optimizer steps of each contender first")
    p.add_argument("--contenders", default="torch_loop,strategy_ddp,strategy_zero2")
    p.add_argument("--name", default="train-interleaved", help="the results are cpu-<date>-<name>.json/.png")
    args = p.parse_args(argv)
    if args.tiny:
        bench_train.shrink_to_tiny(args)
        args.blocks, args.block_steps, args.warmup = 2, 1, 1
    bench_train.resolve_threads(args)
    args.steps = args.blocks * args.block_steps  # the Strategies' max_iters
    return args


def _plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for row in rows[1:]:
        ratios = row["paired"]["ratios"]
        ax.plot(range(1, len(ratios) + 1), ratios, marker="o", ms=3, lw=0.8,
                label=f"{row['contender']}: mean {row['paired']['mean']:.4f} "
                      f"[{row['paired']['ci95'][0]:.4f}, {row['paired']['ci95'][1]:.4f}]")  # fmt: skip
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xlabel("block pair")
    ax.set_ylabel("speed relative to torch_loop (loop block time / contender's)")
    ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    names = [n.strip() for n in args.contenders.split(",") if n.strip()]
    unknown = sorted(set(names) - set(bench_train.CONTENDERS))
    if unknown or not names or names[0] != "torch_loop" or len(set(names)) != len(names):
        raise SystemExit(
            f"--contenders: torch_loop first, then distinct names from {list(bench_train.CONTENDERS)} "
            f"(unknown: {unknown})"
        )
    if args.blocks < 2:
        raise SystemExit("--blocks: at least 2 (the interval needs two pairs)")
    ranks = bench_train.spawn_ranks(_worker, names, args)
    # a block ends at a barrier, so every rank's time is the same block; rank 0's is taken
    block_s = ranks[0]["block_s"]
    tokens = args.block_steps * args.accum * args.micro_batch * args.seq_len * args.world
    rows = []
    for name in names:
        row: dict[str, Any] = {"contender": name, "block_s": block_s[name]}
        row["finish_s_per_rank"] = [r["finish_s"][name] for r in ranks]
        row["cores_per_rank"] = [r["cores"] for r in ranks]
        row["tokens_per_s_median"] = tokens / statistics.median(block_s[name])
        row["paired"] = paired_ratios(block_s["torch_loop"], block_s[name])
        rows.append(row)
    print(f"{args.blocks} blocks x {args.block_steps} steps per contender, ABBA order, {args.world} ranks")
    for row in rows:
        pr = row["paired"]
        print(
            f"  {row['contender']:<26} {row['tokens_per_s_median']:8.0f} tokens/s (median block)  "
            f"x loop: mean {pr['mean']:.4f}  95% [{pr['ci95'][0]:.4f}, {pr['ci95'][1]:.4f}]  "
            f"median {pr['median']:.4f}"
        )
    bench_train.save_results(args, rows, _plot, f"{args.blocks} blocks x {args.block_steps} steps (ABBA)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
