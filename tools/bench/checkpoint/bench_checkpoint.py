# SPDX-License-Identifier: Apache-2.0
"""Cost of a committed checkpoint: save, checksum-verify and load of ``--mb`` MB of fp32 tensors, side by side in
one run with the raw ``dcp.save``/``dcp.load`` underneath and the checksum functions alone.

    python tools/bench/checkpoint/bench_checkpoint.py [--mb 1024] [--repeats 3] [--dir DIR] [--out FILE]

Rows (median of ``--repeats``, seconds and GB/s of checkpoint bytes; the rows alternate within every repeat and
``os.sync()`` runs, untimed, before each):

- ``dcp_save_raw``: ``torch.distributed.checkpoint.save`` into a fresh directory (no manifest, no rename);
- ``save_committed``: stepforge's writer (``checkpoint.save_dir``): the same DCP files in a temporary directory,
  CRC-32 of every file, ``COMMIT.json`` fsynced last, atomic rename;
- ``verify``: ``COMMIT.json`` + size and CRC-32 of every file (what every load does first);
- ``load_committed``: ``checkpoint.load_dir`` (verify, restricted metadata reader, fresh tensors, copy in);
- ``dcp_load_raw``: ``dcp.load`` of the same files, no checks;
- ``crc32_memory`` / ``blake2b_memory`` / ``sha256_memory``: the checksum alone over the same bytes in memory.

The files are usually still in the page cache when verified and loaded (the machine has the memory): the numbers
are the CPU cost of the checks, not a cold disk read. The machine is shared: the load average is recorded before
and after; trust the ratios.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tools/: the `bench` package
from bench.common import _machine
from stepforge.strategy import checkpoint as ck

_TENSOR_MB = 64

#: what `nox -s bench_smoke` runs (tools/bench/smoke.py): seconds, every code path, no timing judged
SMOKE_ARGS = ("--mb", "1", "--repeats", "1", "--out", "{out}")


def _tensors(mb: float) -> dict[str, torch.Tensor]:
    total = int(mb * 1024 * 1024) // 4
    per = min(total, _TENSOR_MB * 1024 * 1024 // 4)
    g = torch.Generator().manual_seed(0)
    out, left, i = {}, total, 0
    while left > 0:
        n = min(per, left)
        out[f"layer{i}.weight"] = torch.randn(n, generator=g)
        left, i = left - n, i + 1
    return out


def _timed(fn: Callable[[], Any], sync: bool = True) -> float:
    if sync:  # not timed: no dirty pages of the previous row are flushed inside this one
        os.sync()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _hash_rate(name: str, data: memoryview) -> Callable[[], Any]:
    if name == "crc32":
        return lambda: zlib.crc32(data)
    return lambda: hashlib.new(name, data).digest()


def run(mb: float, repeats: int, workdir: str, sync: bool = True) -> dict[str, Any]:
    """Time every row at ``mb`` MB inside ``workdir`` (emptied of what it writes); the report as a dict.

    ``sync=False`` skips the ``os.sync()`` before each row (a smoke run: on a busy shared disk each sync can take
    seconds)."""
    state = _tensors(mb)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    raw, committed = os.path.join(workdir, "raw"), os.path.join(workdir, "committed")
    times: dict[str, list[float]] = {}
    target = {k: torch.empty_like(v) for k, v in state.items()}

    def rows_once() -> dict[str, Callable[[], Any]]:
        return {
            "dcp_save_raw": lambda: dcp.save(state, checkpoint_id=raw, no_dist=True),
            "save_committed": lambda: ck.save_dir(
                committed, tensors=state, objects={}, rank_objects={}, meta={"bench": True}
            ),
            "verify": lambda: ck.verify_dir(committed, required=True, where="bench"),
            "load_committed": lambda: ck.load_dir(committed, target),
            "dcp_load_raw": lambda: dcp.load(target, checkpoint_id=raw, no_dist=True),
        }

    with warnings.catch_warnings():  # one process, no group: DCP warns on every call
        warnings.filterwarnings("ignore", message="torch.distributed is .*single process")
        for _ in range(repeats):  # the rows alternate within every repeat: a load change hits them alike
            shutil.rmtree(raw, ignore_errors=True)
            for name, fn in rows_once().items():
                times.setdefault(name, []).append(_timed(fn, sync))
            if not all(torch.equal(target[k], state[k]) for k in state):
                raise AssertionError("the loaded tensors differ from the saved ones")
            for t in target.values():
                t.zero_()
    flat = torch.cat([t.view(-1) for t in state.values()])
    data = memoryview(flat.numpy()).cast("B")
    for name in ("crc32", "blake2b", "sha256"):
        times[f"{name}_memory"] = [_timed(_hash_rate(name, data), sync) for _ in range(repeats)]
    rows = {k: statistics.median(v) for k, v in times.items()}
    shutil.rmtree(raw, ignore_errors=True)
    shutil.rmtree(committed, ignore_errors=True)
    files = {"count": len(state), "tensor_mb": _TENSOR_MB}
    return {
        "bytes": nbytes,
        "gb": round(nbytes / 1e9, 4),
        "files": files,
        "repeats": repeats,
        "seconds": {k: round(v, 4) for k, v in rows.items()},
        "seconds_per_repeat": {k: [round(x, 4) for x in v] for k, v in times.items()},
        "gb_per_s": {k: round(nbytes / 1e9 / v, 3) if v > 0 else None for k, v in rows.items()},
        "ratios": {
            "save_committed / dcp_save_raw": round(rows["save_committed"] / rows["dcp_save_raw"], 3),
            "load_committed / dcp_load_raw": round(rows["load_committed"] / rows["dcp_load_raw"], 3),
            "verify / load_committed": round(rows["verify"] / rows["load_committed"], 3),
            "blake2b / crc32 (memory)": round(rows["blake2b_memory"] / rows["crc32_memory"], 3),
        },
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=1024.0, help="checkpoint size in MiB of fp32 tensors")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--dir", default=None, help="where the checkpoints are written (default: a temporary dir)"
    )
    ap.add_argument(
        "--out", type=Path, default=None, help="JSON report file, or a folder (default: print only)"
    )
    args = ap.parse_args(argv)
    load_before = _machine.load_average()
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-ckpt-") as workdir:
        report = run(args.mb, args.repeats, workdir)
    report["load_average_before"] = load_before
    report["load_average_after"] = _machine.load_average()
    report["machine"] = _machine.machine_info()
    report["note"] = (
        "shared 2-core machine (other jobs running: see the load averages); files mostly in the page cache when "
        "verified and loaded; trust ratios"
    )
    text = json.dumps(report, indent=2)
    # --out: a .json file, or a folder (nox bench_smoke passes one) that gets checkpoint.json
    if args.out is not None:
        out = args.out if args.out.suffix == ".json" else args.out / "checkpoint.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    print(text)
    return report


if __name__ == "__main__":
    main()
