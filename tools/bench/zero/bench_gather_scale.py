# SPDX-License-Identifier: Apache-2.0
"""ZeRO's parameter gather at 8 to 1024 ranks: the local work that grows with the world size.

One process plays rank 0 of each world on torch's fake process group (the collectives move nothing), so what is
timed is what a rank does around them: staging its updated pieces into the tables and copying every rank's row
out of them into the working parameters. The GPT is the gather bench's, bf16 working parameters with fp32
masters (``zero2`` with bf16). Rows per world, each the mean of ``--reps`` waited gathers:

    all_gather               the optimizer's default off gloo (NCCL): every piece staged into one table, one
                             ``all_gather_into_tensor``, the table copied out (``launch_gather(layout, "all_gather")``)
    broadcast (kept tables)  gloo's default: small parameters staged into kept tables, parameters of at least
                             1 Mi elements broadcast in place, one broadcast per rank each
    copy-out per rank        the former copy-out of the all_gather table: one copy per rank and parameter
    floor: one copy of P     copying the model's parameter bytes once, tensor to tensor

with the ``aten.copy_`` calls each gather made (counted once, outside the timing). On a GPU each copy is a kernel
launch (a few microseconds), so the copies column is what the former scheme cost a CUDA step at scale. On the
fake group nothing writes the all_gather's table, so its fresh pages are first touched by its zero fill here
(on the CPU, most of that row's time; on a GPU the table is device memory and the fill one memset).

    python tools/bench/zero/bench_gather_scale.py                 # -> bench-out/cpu-<date>-gather-scale.json/.png
    python tools/bench/zero/bench_gather_scale.py --tiny --out /tmp/x
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tools/: the `bench` package
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))

from bench.common import _machine, _report

ROOT = Path(__file__).resolve().parents[3]

__all__ = ["main"]

#: what `nox -s bench_smoke` runs (tools/bench/smoke.py): seconds, every code path, no timing judged
SMOKE_ARGS = ("--tiny", "--out", "{out}")

FLOOR = "floor: one copy of P"


def _timed(fn: Callable[[], Any], reps: int) -> float:
    fn()  # first call: the tables are made
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e3


def _copies(fn: Callable[[], Any]) -> int:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            Count.n += func is torch.ops.aten.copy_.default
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n


def _copy_out_per_rank(table: torch.Tensor, slots: list[Any], offsets: list[int]) -> None:
    """The former copy-out: every rank's piece of every parameter, one copy each."""
    from stepforge.zero.state.partition import local_range

    world = table.shape[0]
    for slot, offset in zip(slots, offsets, strict=True):
        flat = slot.param.view(-1)
        for src in range(world):
            start, stop = local_range(slot.numel, world, src)
            if stop > start:
                flat[start:stop].copy_(table[src, offset : offset + stop - start])


def _cases(model: torch.nn.Module, world: int) -> dict[str, Callable[[], Any]]:
    """The timed calls at ``world`` ranks (the fake group is up)."""
    from stepforge.zero import LowLevelZeroOptimizer
    from stepforge.zero.comm.param_gather import StagingBuffers, launch_gather

    layout = LowLevelZeroOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3), stage=2).layout
    kept = StagingBuffers()
    slots = [s for s in layout.slots if s.numel]
    offsets = [s.offset for s in slots]
    (part,) = layout.partitions  # one param group, one dtype: one table as the all_gather's
    table = StagingBuffers().table((0, 0), world, sum(s.piece for s in slots), part)
    numel = sum(p.numel() for p in model.parameters())
    src, dst = torch.empty(numel, dtype=torch.bfloat16), torch.empty(numel, dtype=torch.bfloat16)
    return {
        "all_gather": lambda: launch_gather(layout, "all_gather").wait_all(),
        "broadcast (kept tables)": lambda: launch_gather(layout, "broadcast", staging=kept).wait_all(),
        "copy-out per rank": lambda: _copy_out_per_rank(table, slots, offsets),
        FLOOR: lambda: dst.copy_(src),
    }


@torch.no_grad()
def measure(worlds: list[int], size: dict[str, int], reps: int) -> list[dict[str, Any]]:
    """Every world in turn, as rank 0 on the fake group; runs in its own process (``run_isolated``)."""
    from gpt_demo_model import ByteGPT

    from stepforge.testing.fake_world import fake_group

    torch.manual_seed(0)
    model = ByteGPT(size["d_model"], size["layers"], size["heads"], size["seq_len"]).to(torch.bfloat16)
    numel = sum(p.numel() for p in model.parameters())
    rows = []
    for world in worlds:
        with fake_group(0, world):
            for name, fn in _cases(model, world).items():
                rows.append(
                    dict(world=world, case=name, ms=_timed(fn, reps), copies=_copies(fn), params=numel)
                )
    return rows


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "bench-out"))
    p.add_argument("--worlds", type=int, nargs="+", default=[8, 64, 256, 1024])
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--name", default="gather-scale", help="the results are cpu-<date>-<name>.json/.png")
    p.add_argument("--tiny", action="store_true", help="a seconds-long run that only checks the bench works")
    args = p.parse_args(argv)
    if args.tiny:
        args.d_model, args.layers, args.heads, args.seq_len, args.reps = 32, 1, 2, 16, 1
        args.worlds = [8, 64]
    return args


def main(argv: list[str] | None = None) -> int:
    from stepforge.testing.fake_world import run_isolated

    args = parse(argv)
    size = dict(d_model=args.d_model, layers=args.layers, heads=args.heads, seq_len=args.seq_len)
    rows = run_isolated(measure, args.worlds, size, args.reps, timeout=3600)
    floors = {r["world"]: r["ms"] for r in rows if r["case"] == FLOOR}
    for r in rows:
        r["vs_floor"] = r["ms"] / floors[r["world"]]
    print(
        _report.format_table(
            rows,
            [
                ("world", "ranks", "d"),
                ("case", "case", "s"),
                ("ms", "ms", ".2f"),
                ("vs_floor", "x floor", ".1f"),
                ("copies", "copies", "d"),
            ],
        )
    )
    machine = _machine.machine_info(threads=1)
    stem = f"cpu-{datetime.date.today().isoformat()}-{args.name}{'-tiny' if args.tiny else ''}"
    out = Path(args.out)
    config = {k: v for k, v in vars(args).items() if k != "out"}
    _report.save_json(
        out / f"{stem}.json",
        {"machine": machine, "config": config, "params": rows[0]["params"], "rows": rows},
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for case in dict.fromkeys(r["case"] for r in rows):
        mine = [r for r in rows if r["case"] == case]
        ax.plot([r["world"] for r in mine], [r["ms"] for r in mine], marker="o", label=case)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks (fake process group, rank 0)")
    ax.set_ylabel("ms per gather (local work)")
    ax.legend(fontsize=8)
    ax.set_title(
        f"ZeRO parameter gather, {rows[0]['params'] / 1e6:.1f} M-param byte GPT (bf16, fp32 masters), 1 thread; "
        f"{machine.get('cpu', {}).get('model', '')}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(out / f"{stem}.png", dpi=110)
    plt.close(fig)
    print(f"wrote {out / stem}.json and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
