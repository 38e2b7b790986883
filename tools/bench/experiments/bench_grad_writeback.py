# SPDX-License-Identifier: Apache-2.0
"""Cost of the kernels' unscaled-grad write-back (``write_unscaled_grads=True``), side by side in one run.

    python tools/bench/experiments/bench_grad_writeback.py [--numel 20000000] [--tensors 1] [--repeats 15] [--out DIR]

For Adam (fp32, and bf16 params/grads with fp32 masters), SGD (momentum) and LAMB, each step runs with a grad
divisor of 1024 without and with the write-back, alternating, median of ``--repeats``; torch's fused AdamW with
``grad_scale`` (which always writes the unscaled grads back) runs alongside as the reference for Adam fp32.
The grads are restored from a copy before each timed call (not timed), so every call unscales the same values.
"""

from __future__ import annotations

import argparse
import array
import json
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from stepforge.fused import _backend

cpu = _backend.cpu_module()

#: what `nox -s bench_smoke` runs (tools/bench/smoke.py): seconds, every code path, no timing judged
SMOKE_ARGS = ("--numel", "4096", "--tensors", "2", "--repeats", "1", "--out", "{out}")


def _ptrs(ts):
    return array.array("q", [t.data_ptr() for t in ts])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=20_000_000, help="total elements")
    ap.add_argument("--tensors", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    n = args.numel // args.tensors
    sizes = array.array("q", [n] * args.tensors)
    steps = array.array("q", [3] * args.tensors)
    f32, bf16 = torch.float32, torch.bfloat16

    def tensors(dtype=f32, fill=None):
        return [
            torch.randn(n).to(dtype) if fill is None else torch.full((n,), fill) for _ in range(args.tensors)
        ]

    p, g, m, v = tensors(), tensors(), tensors(fill=0.0), tensors(fill=1e-3)
    g0 = [x.clone() for x in g]
    pb, gb = tensors(bf16), tensors(bf16)
    gb0 = [x.clone() for x in gb]
    w = [x.float() for x in pb]

    def adam(write):
        return lambda: cpu.adam(
            _ptrs(p),
            _ptrs(g),
            _ptrs(m),
            _ptrs(v),
            None,
            sizes,
            steps,
            0,
            0,
            1e-3,
            0.9,
            0.999,
            1e-8,
            0.01,
            True,
            True,
            1024.0,
            0,
            False,
            0,
            write_unscaled_grads=write,
        )

    def adam_master(write):
        return lambda: cpu.adam(
            _ptrs(pb),
            _ptrs(gb),
            _ptrs(m),
            _ptrs(v),
            _ptrs(w),
            sizes,
            steps,
            2,
            2,
            1e-3,
            0.9,
            0.999,
            1e-8,
            0.01,
            True,
            True,
            1024.0,
            0,
            False,
            0,
            write_unscaled_grads=write,
        )

    def sgd(write):
        return lambda: cpu.sgd(
            _ptrs(p),
            _ptrs(g),
            _ptrs(m),
            None,
            sizes,
            array.array("q", [0] * args.tensors),
            0,
            0,
            1e-3,
            0.9,
            0.0,
            0.0,
            False,
            False,
            1024.0,
            0,
            False,
            0,
            write_unscaled_grads=write,
        )

    def lamb(write):
        return lambda: cpu.lamb(
            _ptrs(p),
            _ptrs(g),
            _ptrs(m),
            _ptrs(v),
            None,
            sizes,
            steps,
            0,
            0,
            1e-3,
            0.9,
            0.999,
            1e-6,
            0.01,
            True,
            True,
            True,
            False,
            0.0,
            float("inf"),
            1024.0,
            0,
            False,
            0,
            write_unscaled_grads=write,
        )

    state_steps = [torch.tensor(3.0) for _ in p]
    scale, found = torch.tensor(1024.0), torch.zeros(())

    def torch_adamw():
        torch._fused_adamw_(
            p,
            g,
            m,
            v,
            [],
            state_steps,
            lr=1e-3,
            beta1=0.9,
            beta2=0.999,
            weight_decay=0.01,
            eps=1e-8,
            amsgrad=False,
            maximize=False,
            grad_scale=scale,
            found_inf=found,
        )

    cases = {
        "adam_fp32": (adam(False), adam(True), g, g0),
        "adam_bf16_master": (adam_master(False), adam_master(True), gb, gb0),
        "sgd_fp32": (sgd(False), sgd(True), g, g0),
        "lamb_fp32": (lamb(False), lamb(True), g, g0),
    }
    results = {}
    for name, (off, on, grads, saved) in cases.items():
        times = {"off": [], "on": []}
        contenders = [("off", off), ("on", on)] + (
            [("torch_fused_adamw", torch_adamw)] if name == "adam_fp32" else []
        )
        for key, _ in contenders:
            times.setdefault(key, [])
        for r in range(args.repeats + 2):
            for key, fn in contenders:
                for a, b in zip(grads, saved, strict=True):
                    a.copy_(b)
                t0 = time.perf_counter()
                fn()
                dt = time.perf_counter() - t0
                if r >= 2:
                    times[key].append(dt)
        med = {k: statistics.median(t) * 1e3 for k, t in times.items()}
        med["on_over_off"] = med["on"] / med["off"]
        results[name] = med
        print(f"{name:18s} " + "  ".join(f"{k}={val:.3f}" for k, val in med.items()), flush=True)
    doc = {
        "what": "unscaled-grad write-back cost (median ms per step; divisor 1024)",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "numel": args.numel,
        "tensors": args.tensors,
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "isa": cpu.get_isa(),
        "torch": torch.__version__,
        "results": results,
    }
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"cpu-{datetime.now(UTC):%Y-%m-%d}-grad-writeback.json"
        path.write_text(json.dumps(doc, indent=2) + "\n")
        print("wrote", path)


if __name__ == "__main__":
    main()
