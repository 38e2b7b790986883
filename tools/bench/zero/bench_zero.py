# SPDX-License-Identifier: Apache-2.0
"""Data-parallel optimizer schemes on N gloo processes: step time, bytes sent per rank, state memory per rank.

Schemes (fp32 GPT-shaped model, same weights, same data; every rank runs ``torch.set_num_threads(1)``):

    ddp_adamw    DDP (gradient_as_bucket_view) + torch.optim.AdamW(fused=True)
    ddp_torchzero DDP + torch.distributed.optim.ZeroRedundancyOptimizer(AdamW fused)
    fsdp2        FSDP2 fully_shard per block and at the root (reshard_after_forward=True) + torch AdamW
    zero1        stepforge.zero.LowLevelZeroOptimizer(CPUAdam, stage=1)
    zero2        stepforge.zero.LowLevelZeroOptimizer(CPUAdam, stage=2)

Bytes: the collectives are wrapped (``torch.distributed`` functions; DDP's C++ all-reduce through a counting
communication hook that does what DDP's default does) and each call is charged what a bandwidth-optimal ring
sends per rank: all-reduce of S bytes 2(N-1)/N*S, reduce-scatter with S bytes of input (N-1)/N*S, all-gather with
S bytes of output (N-1)/N*S, broadcast of S bytes (N-1)/N*S, all_to_all_single what it sends to the other ranks
(its input less the split it keeps: stepforge.zero's exchange of an S-byte bucket sends (N-1)/N*S). The
theoretical minimum of each scheme is printed beside it, with P = parameter bytes:

    ddp_adamw 2(N-1)/N*P   ddp_torchzero 3(N-1)/N*P   zero1 2(N-1)/N*P   zero2 2(N-1)/N*P
    fsdp2 (N-1)/N*(3*P_blocks + 2*P_root)   (all-gather in forward and again in backward, reduce-scatter;
                                             the root module's parameters stay unsharded between the two)

zero1/zero2 use the optimizer's default ``comm_algorithm="auto"``: on gloo a reduce-scatter made of
``all_to_all_single`` and a local sum ((N-1)/N*P for the gradients, (N-1)/N*P for the parameter gather), and
``overlap_allgather=True`` (``--overlap-allgather off`` waits for the gather in ``step``); with
``--zero-comm all_reduce`` the buckets are all-reduced (2(N-1)/N*P for the gradients, theory 3(N-1)/N*P). Schemes
run interleaved for ``--rounds`` rounds, so a change in the machine's load reaches all of them. The timed steps of a
scheme run back to back after one barrier, each timed from its start to the next one's (the last one waits for
its own parameter gather): an overlapped gather counts in the forward it overlaps, as in training. Before the schemes, every collective is timed on the group
at the bucket sizes stepforge.zero uses (``_collectives.py``): the table behind that choice and behind the
default bucket size.

Memory: bytes of gradient storage + optimizer state (+ fp32 master shards) held per rank after a step, counted
from the tensors each scheme holds (for stepforge.zero the distinct storages behind the gradient pieces, so a
retained bucket would show); the peak RSS of each scheme is reported beside it (the kernel's high-water mark is
reset through ``/proc/self/clear_refs`` before each scheme where the kernel allows it).

    python tools/bench/zero/bench_zero.py                         # 2 and 4 processes -> bench-out/cpu-<date>-zero.json/.png
    python tools/bench/zero/bench_zero.py --world 2 --layers 4 --steps 3
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tools/: the `bench` package

from bench.common import _machine, _report
from bench.common._spawn import free_port, leave_process_group
from bench.zero._collectives import BUCKET_SIZES, time_collectives
from bench.zero._parts import (
    GPT,
    Counter,
    install_counter,
    peak_rss_mib,
    reset_peak_rss,
    save_plot,
)
from bench.zero._schemes import SCHEMES, THEORY_FACTOR, build

__all__ = ["main"]

#: what `nox -s bench_smoke` runs (tools/bench/smoke.py): seconds, every code path, no timing judged
SMOKE_ARGS = ("--quick", "--world", "2", "--out", "{out}")


def _run_scheme(
    scheme: str,
    rank: int,
    args: argparse.Namespace,
    counter: Counter,
    originals: dict[str, Any],
    results: dict[str, Any],
    *,
    first: bool,
) -> None:
    """One round of one scheme: ``args.warmup`` + ``args.steps`` steps; timings are appended to ``results``."""
    torch.manual_seed(0)
    model = GPT(args.vocab, args.d_model, args.layers, args.heads, args.ctx)
    n_params = sum(p.numel() for p in model.parameters())
    root_params = n_params - sum(p.numel() for p in model.blocks.parameters())
    module, optimizer, memory = build(
        scheme, model, counter, originals, args.zero_comm, args.bucket, args.overlap_allgather == "on"
    )
    reset_peak_rss()
    gen = torch.Generator().manual_seed(1234 + rank)
    starts, bytes_per_step, calls = [], [], {}
    # the timed steps run back to back and each is timed from its start to the next one's: an overlapped
    # parameter gather is paid where it lands (the next forward), never in a barrier between steps (gloo's
    # barrier waits for the work in flight, so a per-step barrier would hide the gather from the clock)
    for step in range(args.warmup + args.steps):
        idx = torch.randint(args.vocab, (args.batch, args.ctx), generator=gen)
        if step <= args.warmup:
            dist.barrier()  # warm-up aligned step by step; the last one also lets the warm-up gather land
        counter.reset()
        if step >= args.warmup:
            starts.append(time.perf_counter())
        logits = module(idx[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, args.vocab), idx[:, 1:].reshape(-1))
        if hasattr(optimizer, "backward"):
            optimizer.backward(loss)
        else:
            loss.backward()
        optimizer.step()
        if step == args.warmup + args.steps - 1:
            if hasattr(optimizer, "wait_for_param_gather"):
                optimizer.wait_for_param_gather()  # the last gather has no next forward to hide behind
            mem = memory()  # gradients and state as the step left them
        if step >= args.warmup:
            bytes_per_step.append(counter.ring_bytes)
            calls = dict(counter.calls)
        optimizer.zero_grad()
    ends = [*starts[1:], time.perf_counter()]
    times = [(end - start) * 1e3 for start, end in zip(starts, ends, strict=True)]
    previous = results.get(scheme, {"step_ms": [], "ring_bytes_per_step": []})
    buffers = mem.pop("buffers", 0)
    results[scheme] = {
        "params": n_params,
        "root_params": root_params,
        "step_ms": previous["step_ms"] + times,
        "ring_bytes_per_step": previous["ring_bytes_per_step"] + bytes_per_step,
        "payload_bytes_last_step": counter.payload_bytes,
        "calls_last_step": calls,
        "memory_bytes": mem,
        "buffer_bytes": buffers,
        "final_loss": float(loss.detach()),
        "max_rss_mib": peak_rss_mib() if first else max(peak_rss_mib(), results[scheme]["max_rss_mib"]),
        "comm": {
            k: getattr(optimizer, k, None)
            for k in ("comm_algorithm", "param_gather", "reduce_bucket_size", "overlap_allgather")
        },
    }
    del module, optimizer, model


def _worker(rank: int, world: int, args: argparse.Namespace, schemes: list[str], out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    counter = Counter(world)
    originals = install_counter(counter)
    results: dict[str, Any] = {
        "_collectives": time_collectives(BUCKET_SIZES if not args.quick else (1 << 16,), 3, originals)
    }
    for round_ in range(args.rounds):  # schemes interleaved round by round: drifting load hits them all
        for scheme in schemes:
            _run_scheme(scheme, rank, args, counter, originals, results, first=round_ == 0)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    del results  # the schemes dropped their models and optimizers in _run_scheme
    leave_process_group()


def run_world(world: int, args: argparse.Namespace, schemes: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        mp.start_processes(_worker, args=(world, args, schemes, tmp), nprocs=world, start_method="spawn")
        per_rank = [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world)]
    out: dict[str, Any] = {"_collectives": per_rank[0]["_collectives"]}
    for scheme in schemes:
        ranks = [r[scheme] for r in per_rank]
        n_params = ranks[0]["params"]
        p_bytes = 4 * n_params
        comm = ranks[0]["comm"]
        factor = THEORY_FACTOR[scheme]
        if comm["comm_algorithm"] == "all_reduce":
            factor = 3  # all-reduced gradients (2) + the parameter gather (1)
        theory = factor * (world - 1) / world * p_bytes
        if scheme == "fsdp2":
            # the root's own parameters (embeddings, final norm, head) stay unsharded from forward to backward:
            # gathered once, not twice
            theory -= (world - 1) / world * 4 * ranks[0]["root_params"]
        # a step ends when the slowest rank finishes it
        step_ms = [max(r["step_ms"][i] for r in ranks) for i in range(len(ranks[0]["step_ms"]))]
        sent = max(statistics.median(r["ring_bytes_per_step"]) for r in ranks)
        mem = [sum(r["memory_bytes"].values()) for r in ranks]
        out[scheme] = {
            "world": world,
            "params": n_params,
            "step_ms_median": statistics.median(step_ms),
            "step_ms": step_ms,
            "sent_mib_per_rank": sent / 2**20,
            "theory_mib_per_rank": theory / 2**20,
            "sent_over_theory": sent / theory,
            "calls_per_step": ranks[0]["calls_last_step"],
            "state_mib_per_rank": max(mem) / 2**20,
            "memory_bytes_rank0": ranks[0]["memory_bytes"],
            "max_rss_mib": max(r["max_rss_mib"] for r in ranks),
            "final_loss_rank0": ranks[0]["final_loss"],
            "comm_algorithm": comm["comm_algorithm"] or "-",
            "param_gather": comm["param_gather"] or "-",
            "reduce_bucket_size": comm["reduce_bucket_size"],
            "overlap_allgather": comm["overlap_allgather"],
            "buffer_mib_per_rank": max(r["buffer_bytes"] for r in ranks) / 2**20,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=SCHEMES)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--ctx", type=int, default=65, help="tokens per sequence (+1 for the shifted target)")
    parser.add_argument("--batch", type=int, default=1, help="sequences per rank per step")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per scheme")
    parser.add_argument(
        "--zero-comm",
        default="auto",
        choices=("auto", "all_reduce", "reduce_scatter", "all_to_all"),
        help="LowLevelZeroOptimizer's comm_algorithm for zero1/zero2",
    )
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="rounds over the schemes (interleaved); steps of all rounds count",
    )
    parser.add_argument(
        "--overlap-allgather",
        choices=("on", "off"),
        default="on",
        help="zero1/zero2: LowLevelZeroOptimizer(overlap_allgather=...) (gather overlapped with the next forward)",
    )
    parser.add_argument("--quick", action="store_true", help="a small model and one timed step (smoke run)")
    parser.add_argument(
        "--bucket",
        type=int,
        help="LowLevelZeroOptimizer's reduce_bucket_size (elements; default: its default)",
    )
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    parser.add_argument("--stem", help="file name stem (default cpu-<date>-zero)")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.d_model, args.vocab, args.steps, args.rounds = 2, 128, 2048, 1, 1
    if args.d_model % args.heads:
        parser.error("--d-model must be a multiple of --heads")
    info = _machine.machine_info(threads=1)
    print(f"machine: {info['device']}; load average {info['load_average']}", flush=True)
    rows, collectives = [], []
    started = time.monotonic()
    for world in args.world:
        result = run_world(world, args, list(args.schemes))
        collectives += result.pop("_collectives")
        for scheme, r in result.items():
            rows.append({"scheme": scheme, **r})
        print(f"world {world} done ({time.monotonic() - started:.0f} s)", flush=True)
    info["load_average_after"] = _machine.load_average()
    base = {}
    for r in rows:
        torch_best = min(
            x["step_ms_median"] for x in rows if x["world"] == r["world"] and x["scheme"] in SCHEMES[:3]
        )
        ddp_mem = (
            next(
                x["state_mib_per_rank"]
                for x in rows
                if x["world"] == r["world"] and x["scheme"] == "ddp_adamw"
            )
            if "ddp_adamw" in args.schemes
            else math.nan
        )
        r["time_over_fastest_torch"] = r["step_ms_median"] / torch_best
        r["state_over_ddp"] = r["state_mib_per_rank"] / ddp_mem
        base[r["world"]] = torch_best
    print("gloo collectives at the bucket sizes (ms, slowest rank, median of 3):")
    print(
        _report.format_table(
            collectives,
            [
                ("world", "N", "d"),
                ("elements", "bucket elements", "d"),
                ("mib", "MiB", ".0f"),
                ("all_reduce_ms", "all_reduce", ".1f"),
                ("reduce_scatter_ms", "reduce_scatter", ".1f"),
                ("all_gather_ms", "all_gather", ".1f"),
                ("broadcast_ms", "N broadcasts of 1/N", ".1f"),
                ("all_to_all_ms", "all_to_all", ".1f"),
            ],
        )
    )
    print(
        _report.format_table(
            rows,
            [
                ("scheme", "scheme", ""),
                ("comm_algorithm", "grad comm", ""),
                ("world", "N", "d"),
                ("step_ms_median", "step ms", ".0f"),
                ("time_over_fastest_torch", "vs fastest torch", ".2f"),
                ("sent_mib_per_rank", "sent MiB/rank", ".1f"),
                ("theory_mib_per_rank", "theory MiB", ".1f"),
                ("sent_over_theory", "sent/theory", ".4f"),
                ("state_mib_per_rank", "grad+state MiB", ".1f"),
                ("state_over_ddp", "vs DDP", ".3f"),
                ("buffer_mib_per_rank", "comm buffers MiB", ".1f"),
                ("max_rss_mib", "peak RSS MiB", ".0f"),
            ],
        )
    )
    goals = _goal_ratios(rows)
    for line in goals["lines"]:
        print(line)
    stem = args.stem or f"cpu-{datetime.date.today().isoformat()}-zero"
    model = dict(
        vocab=args.vocab,
        d_model=args.d_model,
        layers=args.layers,
        heads=args.heads,
        ctx=args.ctx,
        batch=args.batch,
    )
    report = {
        "benchmark": "bench_zero",
        "machine": info,
        "model": model,
        "steps": args.steps,
        "warmup": args.warmup,
        "zero_comm": args.zero_comm,
        "overlap_allgather": args.overlap_allgather,
        "rounds": args.rounds,
        "collectives": collectives,
        "goals": goals["ratios"],
        "rows": rows,
    }
    path = _report.save_json(args.out / f"{stem}.json", report)
    print(f"wrote {path}")
    params = rows[0]["params"] / 1e6 if rows else 0
    png = save_plot(
        args.out / f"{stem}.png", rows, f"data-parallel schemes, GPT {params:.1f} M params, fp32, gloo on CPU"
    )
    print(f"wrote {png}")
    return 0


def _goal_ratios(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The speed goals per world: zero2 / DDP and zero1 / torch ZeroRedundancyOptimizer (<= 1.00)."""
    ratios, lines = {}, []
    by = {(r["world"], r["scheme"]): r["step_ms_median"] for r in rows}
    for world in sorted({r["world"] for r in rows}):
        for zero, base in (("zero2", "ddp_adamw"), ("zero1", "ddp_torchzero")):
            if (world, zero) in by and (world, base) in by:
                ratio = by[(world, zero)] / by[(world, base)]
                ratios[f"{zero}_over_{base}_N{world}"] = ratio
                verdict = "met" if ratio <= 1.0 else f"missed by {100 * (ratio - 1):.0f}%"
                lines.append(f"goal N={world}: {zero} / {base} = {ratio:.3f} (<= 1.00: {verdict})")
    return {"ratios": ratios, "lines": lines}


if __name__ == "__main__":
    raise SystemExit(main())
