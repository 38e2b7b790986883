# SPDX-License-Identifier: Apache-2.0
"""Host memory of boosting a big model: a lazy build (``LazyInitContext``) against an eager one, per rank, under
``torch_fsdp``.

    python tools/bench/lazy/bench_lazy.py                  # gpt-1.3b, 4 ranks -> bench-out/cpu-<date>-lazy-boost.*
    python tools/bench/lazy/bench_lazy.py --tiny --out /tmp/x   # seconds (CI keeps it working)

Each rank, in a fresh process: imports, the process group, then the peak resident set is reset
(``/proc/self/clear_refs``) and the rank builds the GPT (``stepforge.strategy.memory.gpt``, seed 0) eagerly or
under ``LazyInitContext`` and boosts it with ``Booster(plugin="torch_fsdp")``. Recorded: RSS after imports, the
peak RSS over build + boost (``VmHWM``), RSS after boost, the rank's share (the bytes of its parameter shards and
buffers), the largest tensor of the model, and the build + boost time.

Modes:

- ``lazy``: ``--world`` real gloo ranks (every rank replays the recorded initialisation and keeps its shards);
- ``lazy-fake``: rank 0 of ``--world`` alone on torch's fake process group (nothing is communicated): the same
  rank as ``lazy`` measured the way ``eager`` is, to show the two ways agree;
- ``eager``: rank 0 of ``--world`` on the fake process group. ``--world`` real ranks of an eager build do not fit
  the shared machine this was measured on (each rank holds the whole fp32 model first: 5.7 GB for gpt-1.3b);
  a rank's eager build and ``fully_shard`` do not communicate, so one rank on the fake group holds what one rank
  of a real run holds.

Goal (issue #40): a lazy rank's peak growth over its RSS after imports at most 1.5x its share plus the largest
tensor. The machine is shared: timings are indicative only; memory is the rank's own.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tools/: the `bench` package
from bench.common import _machine, _report
from stepforge.strategy import Booster, LazyInitContext
from stepforge.strategy.memory.gpt import GPT, GPT_SHAPES, GPTShape
from stepforge.testing.distributed import run_distributed
from stepforge.testing.fake_world import fake_group, run_isolated

__all__ = ["main"]

#: what `nox -s bench_smoke` runs (tools/bench/smoke.py): seconds, every code path, no timing judged
SMOKE_ARGS = ("--tiny", "--modes", "lazy,eager", "--no-plot", "--out", "{out}")

TINY = GPTShape(layers=2, d_model=64, heads=4, vocab=256, context=64)
GOAL_SHARE_FACTOR = 1.5


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def _largest_tensor_bytes(shape: GPTShape) -> int:
    with torch.device("meta"):
        model = GPT(shape)
    return max(t.numel() * t.element_size() for t in model.state_dict().values())


def _measure(rank: int, world: int, shape: GPTShape, lazy: bool) -> dict[str, Any]:
    """One rank: build + boost under ``torch_fsdp``, its memory (the process group is already up)."""
    from torch.distributed.tensor import DTensor

    gc.collect()
    after_imports = _status_bytes("VmRSS")
    _reset_peak()
    t0 = time.perf_counter()
    torch.manual_seed(0)
    if lazy:
        with LazyInitContext():
            model = GPT(shape)
    else:
        model = GPT(shape)
    boosted = Booster(plugin="torch_fsdp").boost(model)[0]
    seconds = time.perf_counter() - t0
    gc.collect()
    module = boosted.unwrap()
    local = [t.to_local() if isinstance(t, DTensor) else t for t in [*module.parameters(), *module.buffers()]]
    row = {
        "rank": rank,
        "world": world,
        "after_imports": after_imports,
        "peak": _status_bytes("VmHWM"),
        "after_boost": _status_bytes("VmRSS"),
        "share": sum(t.numel() * t.element_size() for t in local),
        "largest_tensor": _largest_tensor_bytes(shape),
        "seconds": seconds,
    }
    del boosted, model, module, local
    return row


def _real_rank(rank: int, world: int, shape: GPTShape) -> dict[str, Any]:
    return _measure(rank, world, shape, lazy=True)


def _fake_rank(world: int, shape: GPTShape, lazy: bool) -> dict[str, Any]:
    torch.set_num_threads(1)
    with fake_group(0, world):
        return _measure(0, world, shape, lazy)


def _judge(row: dict[str, Any]) -> dict[str, Any]:
    growth = row["peak"] - row["after_imports"]
    goal = GOAL_SHARE_FACTOR * row["share"] + row["largest_tensor"]
    return {
        **row,
        "peak_growth": growth,
        "goal": goal,
        "growth_over_share": growth / row["share"],
        "meets_goal": growth <= goal,
    }


def run(shape: GPTShape, world: int, modes: list[str], timeout: float) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for mode in modes:
        if mode == "lazy":
            rows = run_distributed(_real_rank, world, shape, timeout=timeout)
        else:
            rows = [run_isolated(_fake_rank, world, shape, mode == "lazy-fake", timeout=timeout)]
        out[mode] = [_judge(r) for r in rows]
    return out


def _gib(n: float) -> float:
    return n / 2**30


def _table(results: dict[str, list[dict[str, Any]]]) -> str:
    rows = [
        {
            "mode": mode,
            "rank": r["rank"],
            "after imports": _gib(r["after_imports"]),
            "peak": _gib(r["peak"]),
            "peak growth": _gib(r["peak_growth"]),
            "share": _gib(r["share"]),
            "goal": _gib(r["goal"]),
            "growth/share": r["growth_over_share"],
            "s": r["seconds"],
        }
        for mode, rs in results.items()
        for r in rs
    ]
    columns = [
        ("mode", "mode", "s"), ("rank", "rank", "d"), ("after imports", "after imports GiB", ".2f"),
        ("peak", "peak GiB", ".2f"), ("peak growth", "growth GiB", ".2f"), ("share", "share GiB", ".2f"),
        ("goal", "goal GiB", ".2f"), ("growth/share", "growth/share", ".2f"), ("s", "build+boost s", ".1f"),
    ]  # fmt: skip
    return _report.format_table(rows, columns)


def _plot(results: dict[str, list[dict[str, Any]]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, growth, share, goal = [], [], [], []
    for mode, rows in results.items():
        for r in rows:
            labels.append(f"{mode}\nrank {r['rank']}")
            growth.append(_gib(r["peak_growth"]))
            share.append(_gib(r["share"]))
            goal.append(_gib(r["goal"]))
    fig, ax = plt.subplots(figsize=(1.3 * len(labels) + 2, 4))
    xs = range(len(labels))
    ax.bar([x - 0.2 for x in xs], growth, 0.4, label="peak RSS growth over build + boost")
    ax.bar([x + 0.2 for x in xs], share, 0.4, label="rank's share (shards + buffers)")
    ax.scatter(list(xs), goal, marker="_", s=600, color="black", label="goal: 1.5 x share + largest tensor")
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("GiB")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt-1.3b", choices=sorted(GPT_SHAPES), help="the GPT shape")
    p.add_argument(
        "--world", type=int, default=4, help="ranks (real for lazy, rank 0 of it on the fake group)"
    )
    p.add_argument("--modes", default="lazy,lazy-fake,eager", help="comma-separated: lazy, lazy-fake, eager")
    p.add_argument("--tiny", action="store_true", help="a 2-layer GPT on 2 ranks, seconds")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per mode")
    p.add_argument("--out", default="bench-out")
    p.add_argument("--stem", default=None)
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    shape = TINY if args.tiny else GPT_SHAPES[args.model]
    world = 2 if args.tiny else args.world
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - {"lazy", "lazy-fake", "eager"}
    if unknown:
        p.error(f"unknown mode(s) {sorted(unknown)}")
    machine = _machine.machine_info()
    free = _machine.available_memory_bytes()
    results = run(shape, world, modes, args.timeout)
    print(_table(results))
    name = "tiny" if args.tiny else args.model
    payload = {
        "benchmark": "host peak RSS per rank of building + boosting a GPT under torch_fsdp, lazy vs eager",
        "model": name,
        "parameters": shape.parameters,
        "world": world,
        "machine": machine,
        "available_memory_before": free,
        "method": {
            "lazy": f"{world} real gloo ranks",
            "lazy-fake": f"rank 0 of {world} on torch's fake process group, alone in its process",
            "eager": f"rank 0 of {world} on torch's fake process group, alone in its process ({world} real eager "
            "ranks do not fit the machine's memory)",
            "peak": "VmHWM after /proc/self/clear_refs reset once the imports and the group were up",
            "goal": f"peak growth <= {GOAL_SHARE_FACTOR} x share + largest tensor",
        },
        "results": results,
        "load_average_after": _machine.load_average(),
    }
    stem = args.stem or f"cpu-{machine['date_utc'][:10]}-lazy-boost" + ("-tiny" if args.tiny else "")
    path = _report.save_json(Path(args.out) / f"{stem}.json", payload)
    if not args.no_plot:
        _plot(
            results,
            Path(args.out) / f"{stem}.png",
            f"{name} ({shape.parameters / 1e9:.2f} B params), torch_fsdp, {world} ranks",
        )
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
