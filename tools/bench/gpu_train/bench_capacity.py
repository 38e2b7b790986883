# SPDX-License-Identifier: Apache-2.0
"""Capacity on one GPU: the deepest GPT (hidden 4096 by default, bf16, AdamW) that trains ``--steps`` steps with a
finite loss under each memory scheme, and the bytes per parameter it held on the device and on the host.

Contenders (``_contenders.py``): ``fused`` (everything on the device: fp32 parameters, gradients and FusedAdam
state, bf16 autocast), ``zero2_offload`` (``zero2`` + ``cpu_offload=True`` + ``HybridAdam``: bf16 parameters on
the device, fp32 masters, gradients and Adam state on the host) and ``gemini`` (FSDP2 + ``CPUOffloadPolicy`` +
``HybridAdam``). Every model is built under ``LazyInitContext`` in its working dtype and materialised by the
contender's plugin where it keeps it: on the GPU, except ``gemini``'s offloaded shards, made on the host (the
initialisation replays on the GPU, a tensor at a time). Each try records its host peak resident size beside the
device bytes.

Search (``_search.py``): per contender, doubling from ``--start-depth`` then bisection, guided by the bytes the
passing tries measured, at most ``--max-tries`` tries and ``--budget-s`` seconds; each try runs in a fresh process
(an out-of-memory error cannot poison the next one) under ``--try-timeout-s``, with a host-memory guard that stops
it before the machine runs out (``--host-limit-gib``). The bracket found is reported as it stands when the budget
ends: ``largest`` is always a measured pass. When ``stepforge.strategy.estimate`` imports, its device and host peaks
for the same configurations are recorded beside the measured ones (after the search, so it cannot hold device
memory during a try).

    python tools/bench/gpu_train/bench_capacity.py --out $OUT                    # on the GPU machine
    python tools/bench/gpu_train/bench_capacity.py --start-depth fused=16,zero2_offload=24,gemini=24 --budget-s 80
    python tools/bench/gpu_train/bench_capacity.py --device cpu --tiny --out /tmp/x  # seconds; what CI runs

Writes ``<out>/<stem>.json`` and ``.png`` (``--stem``, default ``capacity``), the JSON after every try.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tools/: the `bench` package
from bench.common import _machine, _report
from bench.gpu_train import _capacity_report
from bench.gpu_train._gpt import capacity_shape
from bench.gpu_train._memory import host_available_bytes
from bench.gpu_train._search import bracket, next_depth, predict_max_depth

__all__ = ["main"]

#: what `nox -s bench_smoke` runs (tools/bench/smoke.py): seconds, every code path, no timing judged
SMOKE_ARGS = ("--device", "cpu", "--tiny", "--out", "{out}")

CONTENDERS = ("fused", "zero2_offload", "gemini")
GIB = 2**30
#: failures that no depth would avoid: the search stops at the first (its time goes to the other contenders)
NOT_MEMORY = ("error", "loss")


def _per_contender(text: str, names: list[str], cast: type, option: str) -> dict[str, Any]:
    """``"8"`` (every contender) or ``"fused=8,gemini=24"`` (the others keep the plain value, else error); values
    for contenders not run are ignored, names that are no contender are refused."""
    plain = [p for p in text.split(",") if p and "=" not in p]
    named = dict(p.split("=", 1) for p in text.split(",") if "=" in p)
    unknown = sorted(set(named) - set(CONTENDERS))
    if unknown or len(plain) > 1:
        raise SystemExit(
            f"{option}: give one value or name=value pairs for {list(CONTENDERS)} (got {text!r})"
        )
    out = {}
    for name in names:
        if name in named:
            out[name] = cast(named[name])
        elif plain:
            out[name] = cast(plain[0])
        else:
            raise SystemExit(f"{option}: no value for {name} in {text!r}")
    return out


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="a seconds-long run that only checks the bench works")
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--d-model", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=3, help="training steps a try must finish")
    p.add_argument("--start-depth", default="8", help="first depth: N, or name=N per contender")
    p.add_argument("--max-depth", type=int, default=160)
    p.add_argument("--resolution", type=int, default=1, help="stop when the bracket is this many layers wide")
    p.add_argument("--max-tries", default="6", help="tries per contender: N, or name=N")
    p.add_argument("--budget-s", default="80", help="seconds per contender's search: S, or name=S")
    p.add_argument("--try-timeout-s", type=float, default=150.0)
    p.add_argument(
        "--host-limit-gib",
        type=float,
        default=0.0,
        help="resident memory a try may reach (0: the machine's available memory at start less the reserve)",
    )
    p.add_argument("--host-reserve-gib", type=float, default=6.0)
    p.add_argument(
        "--alloc-conf", default="expandable_segments:True", help="PYTORCH_CUDA_ALLOC_CONF of the tries"
    )
    p.add_argument(
        "--no-estimate", action="store_true", help="do not record stepforge.strategy.estimate's figures"
    )
    p.add_argument(
        "--estimate-budget-s", type=float, default=30.0, help="seconds for the estimates after the search"
    )
    p.add_argument("--out", default="bench-out")
    p.add_argument("--stem", default="capacity")
    p.add_argument("--one-try", help=argparse.SUPPRESS)  # child mode: the spec file of one try
    args = p.parse_args(argv)
    if args.tiny:  # the tiny sizes, where the command line left the defaults
        tiny = dict(
            d_model=64,
            heads=4,
            vocab=512,
            seq_len=32,
            batch=2,
            start_depth="1",
            max_depth=4,
            max_tries="fused=2,zero2_offload=1,gemini=1",
            budget_s="120",
        )
        defaults = vars(p.parse_args([]))
        for key, value in tiny.items():
            if getattr(args, key) == defaults[key]:
                setattr(args, key, value)
    if args.resolution < 1:
        raise SystemExit("--resolution: at least 1")
    if args.d_model % args.heads:
        raise SystemExit(f"--heads {args.heads}: must divide --d-model {args.d_model}")
    return args


def _run_try(
    args: argparse.Namespace, name: str, depth: int, timeout: float, host_limit: int, work: Path
) -> dict[str, Any]:
    """One try in a fresh process; its result, or a failure saying why no result came back."""
    spec_path, result_path = work / f"{name}-{depth}.spec.json", work / f"{name}-{depth}.result.json"
    spec = {
        "contender": name,
        "depth": depth,
        "device": args.device,
        "d_model": args.d_model,
        "heads": args.heads,
        "vocab": args.vocab,
        "seq_len": args.seq_len,
        "batch": args.batch,
        "steps": args.steps,
        "host_rss_limit": host_limit,
        "min_available": 2 * GIB,
        "result": str(result_path),
    }
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=args.alloc_conf) if args.alloc_conf else dict(os.environ)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--one-try", str(spec_path)],
            env=env,
            timeout=timeout,
            check=False,
        )
        status = f"exit status {proc.returncode}"
    except subprocess.TimeoutExpired:
        status = None
    wall = time.perf_counter() - t0
    if result_path.exists():
        result = json.loads(result_path.read_text())
        result["process_s"] = wall
        return result
    kind, reason = (
        ("timeout", f"no result within {timeout:.0f} s (killed)")
        if status is None
        else (
            "crash",
            f"the try's process ended without a result ({status}; a negative status is the signal)",
        )
    )
    return {
        "contender": name,
        "depth": depth,
        "parameters": _shape(args, depth).parameters,
        "ok": False,
        "kind": kind,
        "reason": reason,
        "process_s": wall,
    }


def _shape(args: argparse.Namespace, depth: int) -> Any:
    return capacity_shape(
        depth, d_model=args.d_model, heads=args.heads, vocab=args.vocab, seq_len=args.seq_len
    )


def search(args: argparse.Namespace, name: str, host_limit: int, work: Path, save: Any) -> dict[str, Any]:
    """The search for contender ``name``; ``save()`` is called after every try."""
    entry: dict[str, Any] = {"tries": [], "stopped": None}
    start, budget, max_tries = args.start_depth[name], args.budget_s[name], args.max_tries[name]
    t0 = time.perf_counter()
    while True:
        tries = [_capacity_report.as_try(r) for r in entry["tries"]]
        limits = _limits(entry["tries"], host_limit)
        predicted = predict_max_depth(
            tries, lambda d: _shape(args, d).parameters, max_depth=args.max_depth, **limits
        )
        depth = next_depth(
            tries, start=start, max_depth=args.max_depth, resolution=args.resolution, predicted=predicted
        )
        left = budget - (time.perf_counter() - t0)
        if depth is None:
            entry["stopped"] = "resolved"
            break
        if len(tries) >= max_tries:
            entry["stopped"] = f"--max-tries {max_tries} reached"
            break
        if left < 5:
            entry["stopped"] = f"--budget-s {budget:g} spent"
            break
        print(
            f"[{name}] try depth {depth} ({_shape(args, depth).parameters / 1e9:.2f} B parameters), predicted "
            f"deepest {predicted}, {left:.0f} s left",
            flush=True,
        )
        result = _run_try(args, name, depth, min(args.try_timeout_s, left), host_limit, work)
        result["predicted_before"] = predicted
        entry["tries"].append(result)
        print(
            f"[{name}] depth {depth}: {'ok' if result['ok'] else 'FAILED'} {result.get('reason', '')} "
            f"({result.get('process_s', 0):.0f} s)",
            flush=True,
        )
        save()
        if (
            result.get("kind") in NOT_MEMORY
        ):  # a defect, not a bound: deeper or shallower tries would repeat it
            entry["stopped"] = (
                f"a try failed for another reason than memory ({result['kind']}) at depth {depth}"
            )
            break
    entry["search_s"] = time.perf_counter() - t0
    b = bracket([_capacity_report.as_try(r) for r in entry["tries"]])
    entry["bracket"] = {"lo": b.lo, "hi": b.hi}
    passes = {r["depth"]: r for r in entry["tries"] if r["ok"]}
    fails = {r["depth"]: r for r in entry["tries"] if not r["ok"]}
    entry["bound"] = fails[b.hi]["kind"] if b.hi is not None else None
    best = passes.get(b.lo)
    if best is not None:
        t = _capacity_report.as_try(best)
        entry["largest"] = {
            "depth": b.lo,
            "parameters": t.parameters,
            "device_bytes_per_param": None if t.device_bytes is None else t.device_bytes / t.parameters,
            "host_bytes_per_param": None if t.host_bytes is None else t.host_bytes / t.parameters,
        }
    return entry


def _limits(tries: list[dict[str, Any]], host_limit: int) -> dict[str, int | None]:
    """What the predictions compare with: the device's free memory at a try's start, the host limit less the
    try's start-up resident memory."""
    device = next((r["device"].get("free_at_start") for r in tries if r.get("device")), None)
    baseline = next((r["host"]["baseline_rss"] for r in tries if r.get("host")), None)
    return {"device_limit": device, "host_limit": None if baseline is None else host_limit - baseline}


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.one_try:
        from bench.gpu_train._capacity_try import run_try

        run_try(json.loads(Path(args.one_try).read_text()))
    if args.device == "cuda" and not torch.cuda.is_available():  # the parent never initialises CUDA itself
        print(
            "bench_capacity: cannot run here: no CUDA device (torch.cuda.is_available() is False); "
            "use --device cpu --tiny to check the bench",
            file=sys.stderr,
        )
        return 2
    names = [n for n in args.contenders.split(",") if n]
    if sorted(set(names) - set(CONTENDERS)):
        raise SystemExit(f"--contenders: choose from {CONTENDERS}")
    args.start_depth = _per_contender(args.start_depth, names, int, "--start-depth")
    args.max_tries = _per_contender(args.max_tries, names, int, "--max-tries")
    args.budget_s = _per_contender(args.budget_s, names, float, "--budget-s")
    available = host_available_bytes() or 0
    host_limit = (
        int(args.host_limit_gib * GIB)
        if args.host_limit_gib > 0
        else int(available - args.host_reserve_gib * GIB)
    )
    out = Path(args.out)
    config = {k: v for k, v in vars(args).items() if k not in ("out", "one_try")}
    payload: dict[str, Any] = {
        "machine": _machine.machine_info(),
        "config": config,
        "model_build": "LazyInitContext, materialised by each contender's plugin",
        "host_rss_limit": host_limit,
        "host_available_at_start": available,
        "contenders": {},
    }

    def save() -> None:
        _report.save_json(out / f"{args.stem}.json", payload)

    with tempfile.TemporaryDirectory(prefix="capacity-") as tmp:
        for name in names:
            payload["contenders"][name] = {"tries": []}
            entry = search(args, name, host_limit, Path(tmp), save)
            payload["contenders"][name] = entry
            save()
    first = next(
        (r for e in payload["contenders"].values() for r in e["tries"] if r.get("device_name")), None
    )
    payload["device_name"] = first["device_name"] if first else None
    fused = (payload["contenders"].get("fused", {}).get("largest") or {}).get("parameters")
    payload["ratio_to_fused"] = {
        n: (e.get("largest") or {}).get("parameters", 0) / fused
        for n, e in payload["contenders"].items()
        if fused
    }
    payload["estimate"] = {"available": False, "why": "not run yet"}
    print(_capacity_report.summary_table(payload["contenders"]))
    payload["title"] = (
        f"largest GPT (d={args.d_model}, seq {args.seq_len}, batch {args.batch}) trained {args.steps} steps on "
        f"{payload['device_name'] or args.device}; {payload['machine']['memory_gib']} GiB host"
    )
    save()
    _capacity_report.plot(payload, lambda depth: _shape(args, depth).parameters, out / f"{args.stem}.png")
    # last, once everything measured is written: a stage limit that ends the run here loses only the estimate
    payload["estimate"] = (
        {"available": False, "why": "--no-estimate"}
        if args.no_estimate
        else _capacity_report.estimates(args, payload["contenders"], lambda depth: _shape(args, depth))
    )
    save()
    print(f"wrote {out / args.stem}.json and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
