# SPDX-License-Identifier: Apache-2.0
"""Part of ``bench_zero.py``: each gradient/parameter collective timed on the running group at the bucket sizes
stepforge.zero uses, so the bench output shows why an algorithm and a bucket size were chosen.

Per size (fp32 elements of one bucket, all ranks together): ``all_reduce`` of the bucket, ``reduce_scatter`` of it
(each rank receives 1/N), ``all_gather`` of it (each rank contributes 1/N), and one ``broadcast`` of 1/N of it from
every rank in turn (the gather stepforge.zero does on gloo), and ``all_to_all_single`` of it less each rank's own
row (the transport of stepforge.zero's ``"all_to_all"`` reduce-scatter, its gloo default). Median of ``reps`` runs,
slowest rank, after a barrier; milliseconds and the bucket's GB/s.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["BUCKET_SIZES", "time_collectives"]

#: bucket sizes in elements: 1, 4, 12 (ColossalAI's and stepforge.zero's default) and 25 Mi
BUCKET_SIZES = (1 << 20, 4 << 20, 12 << 20, 25 << 20)


def _time(fn: Any, reps: int) -> float:
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    slowest = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # the ranks finish a collective together: slowest counts
    return float(slowest) * 1e3


def time_collectives(sizes: tuple[int, ...], reps: int, originals: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows ``{elements, mib, all_reduce_ms, reduce_scatter_ms, all_gather_ms, broadcast_ms, ...}``;
    ``originals`` are the unwrapped ``torch.distributed`` functions (not charged to the byte counter)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    all_reduce, broadcast = originals["all_reduce"], originals["broadcast"]
    rs_name = "reduce_scatter_single" if "reduce_scatter_single" in originals else "reduce_scatter_tensor"
    ag_name = "all_gather_single" if "all_gather_single" in originals else "all_gather_into_tensor"
    reduce_scatter, all_gather = originals[rs_name], originals[ag_name]
    ops = (all_reduce, reduce_scatter, all_gather, broadcast, originals["all_to_all_single"])
    return [_time_size(elements, world, rank, ops, reps) for elements in sizes]


def _time_size(elements: int, world: int, rank: int, ops: tuple[Any, ...], reps: int) -> dict[str, Any]:
    all_reduce, reduce_scatter, all_gather, broadcast, all_to_all = ops
    per = -(-elements // world)
    bucket = torch.ones(per * world)
    table = bucket.view(world, per)
    row = torch.empty(per)
    mine = table[rank].clone()
    outgoing, others = table[torch.arange(world) != rank].reshape(-1), torch.empty((world - 1) * per)
    splits = [0 if r == rank else per for r in range(world)]  # stepforge.zero's exchange: own row stays put

    def broadcasts() -> None:
        for src in range(world):
            broadcast(table[src], src=src)

    timed = {
        "all_reduce_ms": _time(lambda: all_reduce(bucket), reps),
        "reduce_scatter_ms": _time(lambda: reduce_scatter(row, bucket), reps),
        "all_gather_ms": _time(lambda: all_gather(bucket, mine), reps),
        "broadcast_ms": _time(broadcasts, reps),
        "all_to_all_ms": _time(
            lambda: all_to_all(others, outgoing, output_split_sizes=splits, input_split_sizes=splits),
            reps,
        ),
    }
    mib = bucket.numel() * 4 / 2**20
    return {
        "world": world,
        "elements": elements,
        "mib": mib,
        **timed,
        **{k.replace("_ms", "_gbps"): mib * 2**20 / 1e6 / v for k, v in timed.items()},
    }
