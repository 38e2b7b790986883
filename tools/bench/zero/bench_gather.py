# SPDX-License-Identifier: Apache-2.0
"""ZeRO's parameter gather alone, on the demo GPT and N gloo ranks, beside the collectives it is made of.

What ``bench_train.py`` cannot separate: how long the gather of the updated parameters takes by itself, against
the floor of moving the same bytes (N broadcasts of P/N, one per rank, straight between flat tensors) and against
the exchanges either scheme runs on the gradients (DDP's all-reduce of P, ZeRO's ``all_to_all_single`` of P).
P = the model's parameter bytes; every rank runs ``torch.set_num_threads(1)``; each row is the mean of ``--reps``
calls between barriers, slowest rank.

Gather variants (``stepforge.zero.comm.param_gather.launch_gather`` on a ``LowLevelZeroOptimizer``'s layout, waited;
the bench times this internal directly, as the zero package's tests do, because no public call runs the gather
without the optimizer step around it):

    gather (kept tables)      the optimizer's default: small parameters staged into tables kept between steps,
                              parameters of at least DIRECT_MIN elements broadcast in place
    gather (fresh tables)     the same, tables allocated per call (what it did before they were kept)
    gather (all staged)       every parameter through one kept table (two broadcasts at 2 ranks, copies in/out)

    python tools/bench/zero/bench_gather.py                 # -> bench-out/cpu-<date>-gather.json/.png
    python tools/bench/zero/bench_gather.py --tiny --out /tmp/x
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tools/: the `bench` package
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))

from gpt_demo_model import ByteGPT

from bench.common import _machine, _report
from bench.common._spawn import free_port, leave_process_group

ROOT = Path(__file__).resolve().parents[3]

__all__ = ["main"]

#: what `nox -s bench_smoke` runs (tools/bench/smoke.py): seconds, every code path, no timing judged
SMOKE_ARGS = ("--tiny", "--out", "{out}")

FLOOR = "N broadcasts of P/N"


def _timed(fn: Callable[[], Any], reps: int) -> float:
    dist.barrier()
    fn()  # first call: allocations, connections
    dist.barrier()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    dist.barrier()
    return (time.perf_counter() - start) / reps * 1e3


@torch.no_grad()
def _worker(rank: int, world: int, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    from stepforge.fused import CPUAdam
    from stepforge.zero import LowLevelZeroOptimizer
    from stepforge.zero.comm.grad_reducer import WireFormat
    from stepforge.zero.comm.param_gather import StagingBuffers, launch_gather

    torch.manual_seed(0)
    model = ByteGPT(args.d_model, args.layers, args.heads, args.seq_len)
    layout = LowLevelZeroOptimizer(CPUAdam(model.parameters(), lr=1e-3), stage=2).layout
    numel = sum(p.numel() for p in model.parameters())
    piece = -(-numel // world)
    flat, send, table = torch.randn(numel), torch.randn(world, piece), torch.empty(world, piece)
    others = torch.empty(world - 1, piece)

    def broadcasts() -> None:
        works = [dist.broadcast(table[src], src=src, async_op=True) for src in range(world)]
        for work in works:
            work.wait()

    kept, all_staged = StagingBuffers(), StagingBuffers()
    cases: dict[str, Callable[[], Any]] = {
        "all_reduce of P (DDP's gradient exchange)": lambda: dist.all_reduce(flat),
        # zero2's own exchange on gloo (its own row stays put); send's rows 0..W-2 stand for the other ranks'
        "all_to_all_single of P (zero2's on gloo)": lambda: WireFormat().exchange(
            others, send[:-1], rank=rank, group=None, async_op=False
        ),
        FLOOR: broadcasts,
        "gather (kept tables)": lambda: launch_gather(layout, "broadcast", staging=kept).wait_all(),
        "gather (fresh tables)": lambda: launch_gather(layout, "broadcast").wait_all(),
        "gather (all staged)": lambda: launch_gather(
            layout, "broadcast", direct_min=1 << 62, staging=all_staged
        ).wait_all(),
    }
    result = {name: _timed(fn, args.reps) for name, fn in cases.items()}
    Path(out, f"rank{rank}.json").write_text(json.dumps({"ms": result, "params": numel}))
    del cases
    leave_process_group()


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "bench-out"))
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--name", default="gather", help="the results are cpu-<date>-<name>.json/.png")
    p.add_argument("--tiny", action="store_true", help="a seconds-long run that only checks the bench works")
    args = p.parse_args(argv)
    if args.tiny:
        args.d_model, args.layers, args.heads, args.seq_len, args.reps = 32, 1, 2, 16, 2
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        mp.start_processes(_worker, args=(args.world, args, tmp), nprocs=args.world, start_method="spawn")
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(args.world)]
    names = list(ranks[0]["ms"])
    slowest = {n: max(r["ms"][n] for r in ranks) for n in names}
    rows = [{"case": n, "ms": slowest[n], "vs_floor": slowest[n] / slowest[FLOOR]} for n in names]
    print(
        _report.format_table(
            rows, [("case", "case", "s"), ("ms", "ms", ".2f"), ("vs_floor", "x floor", ".2f")]
        )
    )
    machine = _machine.machine_info(threads=1)
    stem = f"cpu-{datetime.date.today().isoformat()}-{args.name}{'-tiny' if args.tiny else ''}"
    out = Path(args.out)
    config = {k: v for k, v in vars(args).items() if k != "out"}
    _report.save_json(
        out / f"{stem}.json",
        {"machine": machine, "config": config, "params": ranks[0]["params"], "rows": rows},
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    ax.barh([r["case"] for r in rows], [r["ms"] for r in rows], color="tab:blue")
    ax.set_xlabel("ms per call (slowest rank)")
    ax.invert_yaxis()
    ax.set_title(
        f"{ranks[0]['params'] / 1e6:.2f} M-param byte GPT, {args.world} gloo ranks x 1 thread; "
        f"{machine.get('cpu', {}).get('model', '')}; load {machine.get('load_average')}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(out / f"{stem}.png", dpi=110)
    plt.close(fig)
    print(f"wrote {out / stem}.json and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
