# SPDX-License-Identifier: Apache-2.0
"""A/B benchmark of two stepforge-fused builds (e.g. main's and a branch's), side by side in one run.

    python tools/bench/fused/bench_ab.py --a /work/venv/bin/python --b /work/venv-fused/bin/python \\
        --b-path packages/stepforge-fused/src --threads 2 --rounds 9 --out benchmarks/results/fused \\
        --stem cpu-2026-12-07-one-launch-ab

Each side is a worker process (its own interpreter and ``PYTHONPATH`` prefix, ``--a-path``/``--b-path``) that
builds one case at a time (which side allocates first alternates per case) and times ``optimizer.step()``; the
driver alternates them round by round (A then B, then B then A, ...), so both see the same load on a shared
machine, and the workers never run at once. ``--b`` equal to ``--a`` (an A/A run) shows the harness's own spread. Cases:
FusedSGD (momentum 0.9 and none), FusedAdam and CPUAdam on 1 x 50M, 2 000 x 10k and 20 000 x 1k float32 tensors,
the grads kept between steps. Reported per case: the median over rounds of the per-round ratio
``B step time / A step time`` (each the median of ``--steps`` steps) and its spread (min, max); ``< 1`` means
B is faster. Where a case's tensors land holds for all its rounds and changes from one allocation to the next
(on 20 000 x 1k one placement ran a side 25% slower for 101 rounds, the next one not): ``--setups K``
allocates each case K times and pools the rounds of all (``setup_ratios``: each setup's median). Results:
``<out>/<stem>.json`` and ``<out>/<stem>.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tools/: the `bench` package

__all__ = ["main"]

#: what `nox -s bench_smoke` runs (tools/bench/smoke.py): the same build on both sides, tiny shapes
SMOKE_ARGS = ("--quick", "--shapes", "1x1000", "--rounds", "1", "--steps", "1", "--no-plot", "--out", "{out}")

SHAPES = ((1, 50_000_000), (2_000, 10_000), (20_000, 1_000))
OPTIMIZERS = ("FusedSGD", "FusedSGD-momentum", "FusedAdam", "CPUAdam")


def _worker(threads: int) -> None:
    """Answer the driver's commands on stdin, one JSON line each: ``setup``, ``time``, ``teardown``."""
    import torch

    import stepforge.fused as fused

    torch.set_num_threads(threads)
    print(json.dumps({"ready": fused.__file__, "isa": fused.cpu_features()["isa"]}), flush=True)
    opt = None
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "setup":
            count, numel = cmd["shape"]
            gen = torch.Generator().manual_seed(0)
            init, grad = torch.randn(numel, generator=gen), torch.randn(numel, generator=gen).mul_(1e-2)
            params = []
            for i in range(count):
                p = torch.nn.Parameter(init.roll(i % numel))
                p.grad = grad.roll(i % numel)
                params.append(p)
            name = cmd["optimizer"]
            if name.startswith("FusedSGD"):
                opt = fused.FusedSGD(
                    params, lr=0.01, weight_decay=1e-4, momentum=0.9 if "momentum" in name else 0
                )
            else:
                opt = getattr(fused, name)(params, lr=1e-3, weight_decay=0.01)
            for _ in range(2):
                opt.step()  # warm-up: state created, buckets cached
            print(json.dumps({"ok": True}), flush=True)
        elif cmd["op"] == "time":
            assert opt is not None
            samples = []
            for _ in range(cmd["steps"]):
                t0 = time.perf_counter()
                opt.step()
                samples.append((time.perf_counter() - t0) * 1e3)
            print(json.dumps({"ms": statistics.median(samples)}), flush=True)
        elif cmd["op"] == "teardown":
            opt = None
            print(json.dumps({"ok": True}), flush=True)


class _Side:
    def __init__(self, python: str, path: str | None, threads: int) -> None:
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        if path:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [path, env.get("PYTHONPATH")]))
        cmd = [python, __file__, "--worker", "--threads", str(threads)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.info = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"bench_ab: worker {self.proc.args} exited ({self.proc.wait()})")
        return dict(json.loads(line))

    def ask(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--a", default=sys.executable, help="interpreter of side A (the baseline)")
    ap.add_argument("--b", default=sys.executable, help="interpreter of side B")
    ap.add_argument("--a-path", default=None, help="PYTHONPATH prefix of side A")
    ap.add_argument("--b-path", default=None, help="PYTHONPATH prefix of side B")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=9, help="A/B rounds per case and setup")
    ap.add_argument(
        "--setups", type=int, default=1, help="fresh allocations of each case (rounds run on each)"
    )
    ap.add_argument("--steps", type=int, default=5, help="timed steps per side and round (median taken)")
    ap.add_argument("--quick", action="store_true", help="small shapes, 3 rounds (smoke run)")
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="which of " + ", ".join(OPTIMIZERS))
    ap.add_argument("--shapes", default=None, help="COUNTxNUMEL,... instead of the default cases (e.g. 1x16)")
    ap.add_argument("--out", default="bench-out")
    ap.add_argument("--stem", default="cpu-fused-ab")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    if args.worker:
        _worker(args.threads)
        return 0
    from bench.common import _machine, _report

    shapes = ((1, 2_000_000), (200, 10_000), (2_000, 1_000)) if args.quick else SHAPES
    if args.shapes:
        shapes = tuple(tuple(int(v) for v in s.split("x")) for s in args.shapes.split(","))
    rounds = min(3, args.rounds) if args.quick else args.rounds
    a, b = _Side(args.a, args.a_path, args.threads), _Side(args.b, args.b_path, args.threads)
    rows = []
    try:
        for count, numel in shapes:
            for name in args.optimizers.split(","):
                a_ms, b_ms, setup_ratios = [], [], []
                for setup in range(args.setups):
                    # where a case's tensors land (pages, placement) holds for all its rounds and differs from
                    # one allocation to the next: allocate anew per setup, the side allocating first alternating
                    first = (a, b) if (len(rows) + setup) % 2 == 0 else (b, a)
                    for side in first:
                        side.ask(op="setup", shape=[count, numel], optimizer=name)
                    for r in range(rounds):
                        order = (a, b) if r % 2 == 0 else (b, a)
                        got = {id(s): s.ask(op="time", steps=args.steps)["ms"] for s in order}
                        a_ms.append(got[id(a)])
                        b_ms.append(got[id(b)])
                    for side in (a, b):
                        side.ask(op="teardown")
                    setup_ratios.append(
                        statistics.median(y / x for x, y in zip(a_ms[-rounds:], b_ms[-rounds:], strict=True))
                    )
                ratios = [y / x for x, y in zip(a_ms, b_ms, strict=True)]
                row = {
                    "case": f"{name} {count}x{numel}",
                    "a_ms": statistics.median(a_ms),
                    "b_ms": statistics.median(b_ms),
                    "time_ratio_b_over_a": statistics.median(ratios),
                    "ratio_min": min(ratios),
                    "ratio_max": max(ratios),
                    "rounds": {"a_ms": a_ms, "b_ms": b_ms},
                    "setup_ratios": setup_ratios,
                    # for the plot: speed of B relative to A (> 1: B faster), the 3% band as the target
                    "ratio": 1.0 / statistics.median(ratios),
                    "target": 0.97,
                }
                row["met"] = row["time_ratio_b_over_a"] <= 1.03
                rows.append(row)
                print(
                    f"  {row['case']:<30} A {row['a_ms']:8.2f} ms  B {row['b_ms']:8.2f} ms  B/A "
                    f"{row['time_ratio_b_over_a']:.3f} [{row['ratio_min']:.3f}, {row['ratio_max']:.3f}]",
                    flush=True,
                )
    finally:
        a.close()
        b.close()
    payload = {
        "benchmark": "stepforge-fused A/B (step time, interleaved rounds)",
        "a": {"python": args.a, "path": args.a_path, **a.info},
        "b": {"python": args.b, "path": args.b_path, **b.info},
        "threads": args.threads,
        "rounds": rounds,
        "steps_per_round": args.steps,
        "machine": _machine.machine_info(args.threads),
        "rows": rows,
    }
    out = Path(args.out)
    print(f"wrote {_report.save_json(out / f'{args.stem}.json', payload)}")
    if not args.no_plot:
        title = "stepforge-fused B vs A: step-time speed (>1: B faster; bar: the 3% band)"
        print(f"wrote {_report.save_ratio_plot(out / f'{args.stem}.png', rows, title=title)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
