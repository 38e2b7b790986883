# SPDX-License-Identifier: Apache-2.0
"""The cost of CPU offload on one GPU: a ``zero2`` + ``cpu_offload=True`` + ``HybridAdam`` step split into its
phases, beside the plain run (``fused``: everything on the device) of the same model and batch.

Phases of ``zero2_offload`` (``StepClock`` spans, CUDA events and the host clock together; the ZeRO ones through
``LowLevelZeroOptimizer.observe_phases``, :mod:`stepforge.zero.phases`):

    forward          the model's forward and the loss
    backward         autograd, the gradient hooks included; of it:
      grad_to_pieces   the gradient buckets added into the host's fp32 pieces (the device-to-host copy)
    optimizer_step   ``optimizer.step()`` and ``zero_grad``; of it:
      inner_step       the CPU Adam step over the host masters
      param_gather     the updated masters copied into the device's bf16 parameters (the host-to-device copy)

``step_ms`` is the device timeline from the forward's first event to the step's last, the time a step takes
where steps follow each other. ``hidden_cpu_ms`` is how much of the CPU Adam step the device did not wait for: the
host time of ``inner_step`` less the device time between its two events (the device was idle for the rest). The
goal of the issue: ``step_ms`` of offload at the largest size both fit <= 2x the plain run's.

Sizes (``--sizes``): a named shape (``gpt-1.3b``), ``d<width>x<depth>`` (e.g. ``d4096x20``, the capacity search's
shape), or ``largest``: the deepest depth both ``fused`` and ``zero2_offload`` trained in a capacity JSON
(``--capacity-json``), at its width, sequence length and batch.

    python tools/bench/gpu_train/bench_offload.py --out $OUT                                       # gpt-1.3b
    python tools/bench/gpu_train/bench_offload.py --sizes gpt-1.3b,largest --capacity-json $OUT/capacity.json
    python tools/bench/gpu_train/bench_offload.py --device cpu --tiny --out /tmp/x                 # CI's smoke run

Writes ``<out>/<stem>.json`` and ``.png`` (``--stem``, default ``offload``), the JSON after every size.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import re
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tools/: the `bench` package
from bench.common import _machine, _report
from bench.gpu_train._clock import StepClock
from bench.gpu_train._contenders import build_trainer
from bench.gpu_train._gpt import SHAPES, GPTShape, capacity_shape, random_batch
from bench.gpu_train._memory import device_memory, host_peak_rss_bytes, reset_device_peak

__all__ = ["main", "split_step"]

#: what `nox -s bench_smoke` runs (tools/bench/smoke.py): seconds, every code path, no timing judged
SMOKE_ARGS = ("--device", "cpu", "--tiny", "--out", "{out}")

CONTENDERS = ("zero2_offload", "fused")
PHASES = ("forward", "backward", "grad_to_pieces", "optimizer_step", "inner_step", "param_gather")
GOAL_RATIO = 2.0


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="a seconds-long run that only checks the bench works")
    p.add_argument(
        "--sizes", default="gpt-1.3b", help="comma list: a shape name, d<width>x<depth>, or largest"
    )
    p.add_argument("--capacity-json", help="bench_capacity's JSON, for --sizes largest")
    p.add_argument("--batch", type=int, default=8, help="micro-batch (largest: the capacity run's)")
    p.add_argument("--seq-len", type=int, default=1024, help="for d<width>x<depth> sizes")
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default="bench-out")
    p.add_argument("--stem", default="offload")
    args = p.parse_args(argv)
    if args.tiny:  # the tiny sizes, where the command line left the defaults
        defaults = vars(p.parse_args([]))
        for key, value in dict(sizes="tiny,d64x3", batch=2, steps=2, warmup=1, seq_len=32).items():
            if getattr(args, key) == defaults[key]:
                setattr(args, key, value)
    return args


def resolve_size(size: str, args: argparse.Namespace) -> tuple[GPTShape, int]:
    """``(shape, batch)`` of one ``--sizes`` entry."""
    if size in SHAPES:
        return SHAPES[size], args.batch
    match = re.fullmatch(r"d(\d+)x(\d+)", size)
    if match:
        width, depth = int(match[1]), int(match[2])
        return capacity_shape(
            depth, d_model=width, heads=max(1, width // 128), seq_len=args.seq_len
        ), args.batch
    if size == "largest":
        if not args.capacity_json:
            raise SystemExit("--sizes largest needs --capacity-json (bench_capacity.py's JSON)")
        cap = json.loads(Path(args.capacity_json).read_text())
        depths = [(cap["contenders"].get(n, {}).get("largest") or {}).get("depth") for n in CONTENDERS]
        if any(d is None for d in depths):
            raise SystemExit(
                f"--capacity-json: no largest depth for both {CONTENDERS} in {args.capacity_json}"
            )
        c = cap["config"]
        shape = capacity_shape(
            min(depths), d_model=c["d_model"], heads=c["heads"], vocab=c["vocab"], seq_len=c["seq_len"]
        )
        return shape, c["batch"]
    raise SystemExit(f"--sizes: {size!r} is not a shape of {sorted(SHAPES)}, d<width>x<depth> or largest")


def split_step(totals: list[dict[str, dict[str, float]]], step_ms: list[float]) -> dict[str, Any]:
    """The median over steps of each phase's device and host milliseconds, the step time, and the CPU step's
    hidden part (``inner_step`` host less device time, at least 0, at most the host time)."""
    out: dict[str, Any] = {"step_ms": statistics.median(step_ms)}
    for phase in PHASES:
        per_step = [t[phase] for t in totals if phase in t]
        if per_step:
            out[f"{phase}_ms"] = statistics.median(p["device_ms"] for p in per_step)
            out[f"{phase}_host_ms"] = statistics.median(p["host_ms"] for p in per_step)
            out[f"{phase}_count"] = per_step[0]["count"]
    hidden = [
        min(t["inner_step"]["host_ms"], max(0.0, t["inner_step"]["host_ms"] - t["inner_step"]["device_ms"]))
        for t in totals
        if "inner_step" in t
    ]
    if hidden:
        out["hidden_cpu_ms"] = statistics.median(hidden)
        out["hidden_cpu_fraction"] = (
            out["hidden_cpu_ms"] / out["inner_step_host_ms"] if out["inner_step_host_ms"] else None
        )
    return out


def measure(
    name: str, shape: GPTShape, batch: int, args: argparse.Namespace, device: torch.device
) -> dict[str, Any]:
    """Contender ``name``: warm-up steps, then ``--steps`` steps each timed by phase."""
    reset_device_peak(device)
    trainer = build_trainer(name, shape, device)
    clock = StepClock(device)
    if trainer.zero is not None:
        trainer.zero.observe_phases(clock.span)
    totals, step_ms, losses = [], [], []
    for i in range(args.warmup + args.steps):
        x, y = random_batch(shape, batch, i, device)
        clock.clear()
        with clock.span("total"):
            with clock.span("forward"):
                loss = trainer.forward_loss(x, y)
            with clock.span("backward"):
                trainer.backward(loss)
            with clock.span("optimizer_step"):
                trainer.step()
        t = clock.totals()  # synchronises: steps are timed one by one
        losses.append(float(loss.detach()))
        if i >= args.warmup:
            totals.append(t)
            step_ms.append(t["total"]["device_ms"])
    row = {
        "contender": name,
        "parameters": shape.parameters,
        "batch": batch,
        "seq_len": shape.seq_len,
        "tokens_per_step": batch * shape.seq_len,
        **split_step(totals, step_ms),
        "losses_finite": all(math.isfinite(v) for v in losses),
        "steps": totals,
        "peak_device_bytes": device_memory(device)["peak_allocated"],
        "peak_host_rss_bytes": host_peak_rss_bytes(),
    }
    if trainer.zero is not None:
        trainer.zero.observe_phases(None)
    del trainer
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def _plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4.8))
    labels = [f"{r['size']}\n{r['contender']}" for r in rows]
    parts = (
        ("forward_ms", "forward", "tab:green"),
        ("backward_ms", "backward (device)", "tab:orange"),
        ("inner_step_host_ms", "CPU Adam (host)", "tab:purple"),
        ("param_gather_ms", "H2D params", "tab:red"),
    )
    bottom = [0.0] * len(rows)
    for key, label, colour in parts:
        values = [r.get(key) or 0.0 for r in rows]
        ax.bar(labels, values, bottom=bottom, color=colour, label=label)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.scatter(labels, [r["step_ms"] for r in rows], color="black", zorder=3, label="step (device timeline)")
    for i, r in enumerate(rows):
        if r.get("grad_to_pieces_ms") is not None:
            ax.text(
                i,
                r["step_ms"],
                f" D2H {r['grad_to_pieces_ms']:.0f} ms\n hidden {r.get('hidden_cpu_ms', 0):.0f} ms",
                fontsize=7,
                va="bottom",
            )
    ax.set_ylabel("ms per step (median)")
    ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "bench_offload: cannot run here: no CUDA device (torch.cuda.is_available() is False); "
            "use --device cpu --tiny to check the bench",
            file=sys.stderr,
        )
        return 2
    device = torch.device(args.device)
    names = [n for n in args.contenders.split(",") if n]
    if not names or sorted(set(names) - set(CONTENDERS)):
        raise SystemExit(f"--contenders: any of {CONTENDERS}")
    sizes = [(s, *resolve_size(s, args)) for s in args.sizes.split(",") if s]
    info = _machine.machine_info()
    info["gpu"] = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    info["torch_cuda"] = torch.version.cuda
    out = Path(args.out)
    payload: dict[str, Any] = {
        "machine": info,
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "goal_offload_over_plain": GOAL_RATIO,
        "pytorch_cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "rows": [],
    }
    for size, shape, batch in sizes:
        rows = []
        for name in names:
            print(f"# {size} ({shape.parameters / 1e9:.2f} B parameters, batch {batch}): {name}", flush=True)
            try:
                rows.append({"size": size, **measure(name, shape, batch, args, device)})
            except torch.OutOfMemoryError as exc:  # recorded; the other contenders and sizes still run
                rows.append({"size": size, "contender": name, "parameters": shape.parameters, "batch": batch,
                             "error": f"OutOfMemoryError: {str(exc).splitlines()[0]}"})  # fmt: skip
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        plain = next((r for r in rows if r["contender"] == "fused" and "step_ms" in r), None)
        for r in rows:
            r["over_plain"] = r["step_ms"] / plain["step_ms"] if plain and "step_ms" in r else None
        payload["rows"] += rows
        _report.save_json(out / f"{args.stem}.json", payload)
    print(
        _report.format_table(
            payload["rows"],
            [
                ("size", "size", "s"),
                ("contender", "contender", "s"),
                ("step_ms", "step ms", ".1f"),
                ("forward_ms", "fwd", ".1f"),
                ("backward_ms", "bwd", ".1f"),
                ("grad_to_pieces_ms", "D2H", ".1f"),
                ("inner_step_host_ms", "CPU Adam", ".1f"),
                ("param_gather_ms", "H2D", ".1f"),
                ("hidden_cpu_ms", "hidden", ".1f"),
                ("over_plain", "x plain", ".2f"),
            ],
        )
    )
    title = f"zero2 + cpu_offload + HybridAdam vs all-on-device FusedAdam on {info['gpu'] or 'CPU'}; {info['cpu']['model']}"
    _plot([r for r in payload["rows"] if "step_ms" in r], out / f"{args.stem}.png", title)
    print(f"wrote {out / args.stem}.json and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
