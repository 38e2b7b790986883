# SPDX-License-Identifier: Apache-2.0
"""End to end: the demo's byte-level GPT trained on N gloo ranks by a plain torch loop and by stepforge's stack.

Contenders (same weights, same data, same accumulation; each runs in its own fresh processes so that peak RSS is
its own; every rank runs ``torch.set_num_threads(cores // N)``):

    torch_loop       DDP + torch.optim.AdamW(fused=True), accumulation written by hand with ``no_sync``
    strategy_ddp     Strategy(plugin="torch_ddp") + ColossalAIOptimWrapper, torch AdamW(fused=True)
    strategy_fsdp    Strategy(plugin="torch_fsdp") + ColossalAIOptimWrapper, torch AdamW
    strategy_fsdp_noreshard   the same with reshard_after_forward=False (blocks stay gathered until backward)
    strategy_fsdp_prefetch    the same with FSDP1's forward_prefetch=True, backward_prefetch="BACKWARD_PRE"
    strategy_fsdp_prefetch2   the same prefetching two blocks ahead (prefetch_blocks=2)
    strategy_zero1   Strategy(plugin="zero1", fp32, overlap_allgather) + ColossalAIOptimWrapper, stepforge CPUAdam
    strategy_zero2   Strategy(plugin="zero2", fp32, overlap_allgather) + ColossalAIOptimWrapper, stepforge CPUAdam
    strategy_zero2_waitgather   the same with ColossalAI's default overlap_allgather=False

(``overlap_allgather=True``, a ColossalAI ``LowLevelZeroPlugin`` argument: the updated parameters are gathered
while the next forward runs; its wait then counts in the forward.)

Printed per contender: tokens/s and its ratio to ``torch_loop``; the time of one optimizer step split into
forward, backward (compute), communication wait and optimizer step; peak RSS per rank. The communication wait
is what a synchronising backward costs beyond a ``no_sync`` one (the mean of the last micro-step's backward
minus the mean of the others), so it is measured the same way for every contender, whatever engine moves the
bytes; for a plugin that communicates in ``step`` the wait shows up there instead.

    python tools/bench/train/bench_train.py                       # -> bench-out/cpu-<date>-train.json/.png
    python tools/bench/train/bench_train.py --tiny --out /tmp/x   # seconds; what CI runs to keep it working
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tools/: the `bench` package
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))

from gpt_demo_model import ByteGPT, load_corpus, sample_batch

from bench.common import _machine, _report
from bench.common._spawn import free_port, leave_process_group

ROOT = Path(__file__).resolve().parents[3]

__all__ = [
    "CONTENDERS",
    "Built",
    "add_model_arguments",
    "build",
    "main",
    "pin_rank",
    "resolve_threads",
    "save_results",
    "shrink_to_tiny",
    "spawn_ranks",
]

#: what `nox -s bench_smoke` runs (tools/bench/smoke.py): seconds, every code path, no timing judged
SMOKE_ARGS = ("--tiny", "--out", "{out}")

_PREFETCH = dict(type="torch_fsdp", forward_prefetch=True, backward_prefetch="BACKWARD_PRE")
#: contender -> (plugin name or config, optimizer config); None plugin = the plain torch loop
CONTENDERS: dict[str, tuple[str | dict[str, Any] | None, dict[str, Any]]] = {
    "torch_loop": (None, {"type": "AdamW", "fused": True}),
    "strategy_ddp": ("torch_ddp", {"type": "AdamW", "fused": True}),
    "strategy_fsdp": ("torch_fsdp", {"type": "AdamW"}),
    "strategy_fsdp_noreshard": (dict(type="torch_fsdp", reshard_after_forward=False), {"type": "AdamW"}),
    "strategy_fsdp_prefetch": (_PREFETCH, {"type": "AdamW"}),
    "strategy_fsdp_prefetch2": (dict(_PREFETCH, prefetch_blocks=2), {"type": "AdamW"}),
    # ZeRO keeps ColossalAI's fp16 default; the loop it is compared with is fp32
    "strategy_zero1": (dict(type="zero1", precision="fp32", overlap_allgather=True), {"type": "CPUAdam"}),
    "strategy_zero2": (dict(type="zero2", precision="fp32", overlap_allgather=True), {"type": "CPUAdam"}),
    "strategy_zero2_waitgather": (dict(type="zero2", precision="fp32"), {"type": "CPUAdam"}),
}
LR = 3e-4


@dataclass
class Built:
    """One contender ready to train: the model to call, the context of a micro-step that must not synchronise
    (the loop uses it on all but the window's last), backward, the optimizer step (with zero_grad), and what
    finishes the step's asynchronous work (a ZeRO parameter gather overlapped with the next forward)."""

    model: Any
    no_sync: Callable[[], AbstractContextManager[Any]]
    backward: Callable[[torch.Tensor], None]
    step: Callable[[], None]
    finish: Callable[[], None]


def build(name: str, args: argparse.Namespace) -> Built:
    """Contender ``name`` (a key of :data:`CONTENDERS`) on the model ``args`` describes."""
    torch.manual_seed(0)
    model = ByteGPT(args.d_model, args.layers, args.heads, args.seq_len)
    plugin, opt_cfg = CONTENDERS[name]
    if plugin is None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=LR, fused=True)

        def backward(loss: torch.Tensor) -> None:
            (loss / args.accum).backward()

        def step() -> None:
            opt.step()
            opt.zero_grad(set_to_none=True)

        return Built(ddp, ddp.no_sync, backward, step, finish=lambda: None)
    from stepforge.strategy import Strategy
    from stepforge.zero.low_level import LowLevelZeroOptimizer

    strategy = Strategy(
        plugin=plugin, mixed_precision=None, work_dir=args.work_dir, log_kwargs=dict(console=False)
    )
    wrapped, wrapper = strategy.prepare(
        model,
        optim_wrapper=dict(
            type="ColossalAIOptimWrapper", optimizer=dict(lr=LR, **opt_cfg), accumulative_counts=args.accum
        ),
        dispatch_kwargs=dict(max_iters=(args.warmup + args.steps) * args.accum),
    )

    def wrapper_step() -> None:
        wrapper.step()
        wrapper.zero_grad()

    def wrapper_backward(loss: torch.Tensor) -> None:
        wrapper.backward(wrapper.scale_loss(loss))

    zero = wrapper.optimizer if isinstance(wrapper.optimizer, LowLevelZeroOptimizer) else None
    return Built(
        wrapped,
        lambda: wrapper.optim_context(wrapped),
        wrapper_backward,
        wrapper_step,
        finish=zero.wait_for_param_gather if zero is not None else lambda: None,
    )


def pin_rank(rank: int, cores_per_rank: int) -> list[int] | None:
    """Pin this rank's process to its own ``cores_per_rank`` cores (rank ``r``: the ``r``-th block of the usable
    cores, in order) before any thread starts, so its compute threads and the threads gloo starts later share only
    those; ``0``: no pinning (``None``)."""
    if cores_per_rank <= 0:
        return None
    usable = sorted(os.sched_getaffinity(0))
    cores = usable[rank * cores_per_rank : (rank + 1) * cores_per_rank]
    os.sched_setaffinity(0, cores)
    return cores


def _worker(rank: int, world: int, name: str, args: argparse.Namespace, out: str) -> None:
    cores = pin_rank(rank, args.cores_per_rank)
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    corpus = load_corpus(args.corpus_bytes)
    built = build(name, args)
    model, context, backward, step = built.model, built.no_sync, built.backward, built.step
    fwd, bwd_sync, bwd_local, opt_ms, losses = [], [], [], [], []
    plain = CONTENDERS[name][0] is None
    t_start = 0.0
    for it in range((args.warmup + args.steps) * args.accum):
        if it == args.warmup * args.accum:
            dist.barrier()
            t_start = time.perf_counter()
        measured = it >= args.warmup * args.accum
        last = (it + 1) % args.accum == 0
        x, y = sample_batch(corpus, args.seq_len, args.micro_batch, 0, it, rank)
        # the torch loop skips DDP's all-reduce inside the window by hand; the wrapper decides it itself
        ctx = context() if (not plain or not last) else nullcontext()
        t0 = time.perf_counter()
        with ctx:
            loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
            t1 = time.perf_counter()
            backward(loss)
        t2 = time.perf_counter()
        if measured:
            fwd.append(t1 - t0)
            (bwd_sync if last else bwd_local).append(t2 - t1)
            losses.append(float(loss.detach()))
        if last:
            t3 = time.perf_counter()
            step()
            if measured:
                opt_ms.append(time.perf_counter() - t3)
    dist.barrier()
    wall = time.perf_counter() - t_start
    ms = 1e3
    compute_bwd = statistics.fmean(bwd_local) if bwd_local else statistics.fmean(bwd_sync)
    result = {
        "wall_s": wall,
        "tokens": args.steps * args.accum * args.micro_batch * args.seq_len * world,
        # per optimizer step (accum micro-steps)
        "forward_ms": ms * sum(fwd) / args.steps,
        "backward_ms": ms * compute_bwd * args.accum,
        "comm_wait_ms": ms * max(0.0, statistics.fmean(bwd_sync) - compute_bwd),
        "optimizer_ms": ms * statistics.fmean(opt_ms),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "losses": losses,
        "cores": cores,
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    del built, model, context, backward, step  # what holds the group (DDP, the Strategy), before it goes
    leave_process_group()


def spawn_ranks(worker: Callable[..., None], what: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run ``worker(rank, world, what, args, folder)`` on ``args.world`` fresh gloo processes and return what each
    rank wrote to ``folder/rank<r>.json``. The Strategies' logs go to that temporary folder, not the checkout."""
    with tempfile.TemporaryDirectory() as tmp:
        args.work_dir = tmp
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS=str(args.threads)
        )
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        mp.start_processes(
            worker, args=(args.world, what, args, tmp), nprocs=args.world, start_method="spawn"
        )
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(args.world)]


def run_contender(name: str, args: argparse.Namespace) -> dict[str, Any]:
    ranks = spawn_ranks(_worker, name, args)
    wall = max(r["wall_s"] for r in ranks)
    row: dict[str, Any] = {"contender": name, "plugin": CONTENDERS[name][0] or "DDP (hand-written loop)"}
    row["optimizer"] = CONTENDERS[name][1]["type"]
    row["tokens_per_s"] = ranks[0]["tokens"] / wall
    for key in ("forward_ms", "backward_ms", "comm_wait_ms", "optimizer_ms"):
        row[key] = statistics.fmean(r[key] for r in ranks)
    row["peak_rss_mib_per_rank"] = [r["peak_rss_mib"] for r in ranks]
    row["final_loss_rank0"] = ranks[0]["losses"][-1]
    row["cores_per_rank"] = [r["cores"] for r in ranks]
    return row


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The options of the run that every contender shares (also bench_train_interleaved's)."""
    p.add_argument("--world", type=int, default=2)
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="compute threads per rank (0: --cores-per-rank if given, else cores // world, at least 1)",
    )
    p.add_argument(
        "--cores-per-rank",
        type=int,
        default=0,
        help="pin rank r to the r-th block of this many usable cores (0: no pinning); with --threads below it, "
        "the rank's other cores are left to communication (gloo's threads)",
    )
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--corpus-bytes", type=int, default=2_000_000)
    p.add_argument("--tiny", action="store_true", help="a seconds-long run that only checks the bench works")


def shrink_to_tiny(args: argparse.Namespace) -> None:
    """``--tiny``: a one-block model on a small corpus."""
    args.d_model, args.layers, args.heads, args.seq_len, args.micro_batch = 32, 1, 2, 16, 2
    args.corpus_bytes = 100_000


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p)
    p.add_argument("--out", default=str(ROOT / "bench-out"))
    p.add_argument("--steps", type=int, default=8, help="measured optimizer steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed optimizer steps first")
    p.add_argument(
        "--rounds", type=int, default=1, help="run every contender this many times, keep the median"
    )
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--name", default="train", help="the results are cpu-<date>-<name>.json/.png")
    args = p.parse_args(argv)
    if args.tiny:
        shrink_to_tiny(args)
        args.steps, args.warmup = 1, 1
    resolve_threads(args)
    return args


def resolve_threads(args: argparse.Namespace) -> None:
    """Check ``--cores-per-rank`` against the usable cores and ``--threads`` against it; fill in ``--threads``."""
    usable = len(os.sched_getaffinity(0))
    if args.cores_per_rank < 0 or args.world * args.cores_per_rank > usable:
        raise SystemExit(
            f"--cores-per-rank {args.cores_per_rank}: {args.world} ranks x {args.cores_per_rank} cores needs more "
            f"than the {usable} usable cores; at most {usable // args.world}"
        )
    if args.threads <= 0:
        args.threads = args.cores_per_rank or max(1, usable // args.world)
    if args.cores_per_rank and args.threads > args.cores_per_rank:
        raise SystemExit(
            f"--threads {args.threads} above --cores-per-rank {args.cores_per_rank} oversubscribes each rank's cores"
        )


def _plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["contender"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    left.bar(names, [r["ratio_to_torch_loop"] for r in rows], color="tab:blue")
    left.axhline(1.0, color="black", lw=0.8)
    left.axhline(0.97, color="tab:red", ls="--", lw=0.8, label="0.97 (within 3%)")
    left.set_ylabel("tokens/s relative to the plain torch loop")
    left.legend()
    bottom = [0.0] * len(rows)
    for key, colour in (("forward_ms", "tab:green"), ("backward_ms", "tab:orange"),
                        ("comm_wait_ms", "tab:red"), ("optimizer_ms", "tab:purple")):  # fmt: skip
        values = [r[key] for r in rows]
        right.bar(names, values, bottom=bottom, color=colour, label=key.removesuffix("_ms"))
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    right.set_ylabel("ms per optimizer step (rank mean)")
    right.legend()
    for ax in (left, right):
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save_results(
    args: argparse.Namespace,
    rows: list[dict[str, Any]],
    plot: Callable[[list[dict[str, Any]], Path, str], None],
    timed: str,
) -> None:
    """Write ``<out>/cpu-<date>-<name>[-tiny].json`` (machine, options, parameter count, ``rows``) and the ``.png``
    that ``plot`` draws, titled with the model, the ranks and ``timed`` (what was measured)."""
    n_params = sum(
        p.numel() for p in ByteGPT(args.d_model, args.layers, args.heads, args.seq_len).parameters()
    )
    machine = _machine.machine_info(threads=args.threads)
    config = {k: v for k, v in vars(args).items() if k not in ("out", "work_dir")}
    out = Path(args.out)
    stem = f"cpu-{datetime.date.today().isoformat()}-{args.name}{'-tiny' if args.tiny else ''}"
    _report.save_json(
        out / f"{stem}.json", {"machine": machine, "config": config, "params": n_params, "rows": rows}
    )
    pinned = f" (pinned, {args.cores_per_rank} cores each)" if args.cores_per_rank else ""
    title = (f"{n_params / 1e6:.2f} M-param byte GPT, {args.world} gloo ranks x {args.threads} threads{pinned}, "
             f"accum {args.accum}, {timed}; {machine.get('cpu', {}).get('model', '')}; "
             f"load {machine.get('load_average')}")  # fmt: skip
    plot(rows, out / f"{stem}.png", title)
    print(f"wrote {out / stem}.json and .png")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    names = [n.strip() for n in args.contenders.split(",") if n.strip()]
    unknown = sorted(set(names) - set(CONTENDERS))
    if unknown or "torch_loop" not in names:
        raise SystemExit(
            f"--contenders: unknown {unknown}; choose from {list(CONTENDERS)} (torch_loop required)"
        )
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for _ in range(args.rounds):
        for name in names:  # round-robin, so slow drift of the machine's load hits every contender alike
            runs[name].append(run_contender(name, args))
    rows = [sorted(runs[n], key=lambda r: r["tokens_per_s"])[len(runs[n]) // 2] for n in names]
    for name, row in zip(names, rows, strict=True):  # every round, in run order, to judge the spread
        row["tokens_per_s_rounds"] = [r["tokens_per_s"] for r in runs[name]]
    base = rows[0]["tokens_per_s"]
    for row in rows:
        row["ratio_to_torch_loop"] = row["tokens_per_s"] / base
    cols = [("contender", "contender", "s"), ("optimizer", "optimizer", "s"), ("tokens_per_s", "tokens/s", ".0f"),
            ("ratio_to_torch_loop", "x loop", ".3f"), ("forward_ms", "fwd ms", ".1f"),
            ("backward_ms", "bwd ms", ".1f"), ("comm_wait_ms", "comm ms", ".1f"),
            ("optimizer_ms", "opt ms", ".1f")]  # fmt: skip
    print(_report.format_table(rows, cols))
    for row in rows:
        print(
            f"  {row['contender']:<15} peak RSS per rank (MiB): {[round(v) for v in row['peak_rss_mib_per_rank']]}"
        )
    save_results(args, rows, _plot, f"{args.steps} steps")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
