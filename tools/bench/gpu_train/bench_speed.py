# SPDX-License-Identifier: Apache-2.0
"""Speed on one GPU: GPT-2 124 M and a 1.3 B GPT trained through stepforge's ``Booster`` and ``Strategy`` against the
plain torch loop (same model, ``AdamW(fused=True)``, bf16 autocast, same batches): tokens/s, the ratio to the loop,
model FLOPs utilisation against the device's dense bf16 peak (``_flops.py``: ``6 P + 12 L d T`` FLOPs per token)
and ColossalAI's ``8 P`` TFLOPS beside it. ``--compile`` adds both sides under ``torch.compile``.

Timing: CUDA events around blocks of ``--steps`` optimizer steps after ``--warmup`` untimed ones; ``--rounds``
blocks per contender in ABBA order. Where every contender of a model fits on the device at once (``16 B`` per
parameter each, under half the device's memory) they are built once and their blocks alternate; otherwise each
is built, timed and freed in turn, every round (a dedicated GPU drifts little, but the order still alternates).
Goals (in the JSON): every stepforge contender within 3 % of its loop (``ratio >= 0.97``), 124 M at >= 30 % MFU.

    python tools/bench/gpu_train/bench_speed.py --out $OUT                       # both models, eager
    python tools/bench/gpu_train/bench_speed.py --models gpt2-124m --compile     # + torch.compile (minutes)
    python tools/bench/gpu_train/bench_speed.py --device cpu --tiny --out /tmp/x # seconds; what CI runs

Writes ``<out>/<stem>.json`` and ``.png`` (``--stem``, default ``speed``), the JSON after every model.
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tools/: the `bench` package
from bench.common import _machine, _report
from bench.gpu_train._contenders import CONTENDERS, Trainer, build_trainer
from bench.gpu_train._flops import colossalai_tflops, mfu, model_tflops, peak_bf16_tflops
from bench.gpu_train._gpt import SHAPES, GPTShape, random_batch
from bench.gpu_train._memory import device_memory, reset_device_peak

__all__ = ["main"]

#: what `nox -s bench_smoke` runs (tools/bench/smoke.py): seconds, every code path (aot_eager: the compiled
#: contenders without Inductor's code generation), no timing judged
SMOKE_ARGS = ("--device", "cpu", "--tiny", "--compile", "--compile-backend", "aot_eager", "--out", "{out}")

EAGER = ("torch_loop", "booster", "strategy")
COMPILED = ("torch_loop_compiled", "booster_compiled")
#: contender -> the loop it is compared with
BASELINE = {
    name: "torch_loop_compiled" if CONTENDERS[name].compiled else "torch_loop" for name in (*EAGER, *COMPILED)
}
GOAL_RATIO, GOAL_MFU_124M = 0.97, 0.30


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="a seconds-long run that only checks the bench works")
    p.add_argument("--models", default="gpt2-124m,gpt-1.3b", help=f"comma list of {sorted(SHAPES)}")
    p.add_argument("--contenders", default=",".join(EAGER))
    p.add_argument("--compile", action="store_true", help=f"also {', '.join(COMPILED)} (on --compile-models)")
    p.add_argument("--compile-models", default="gpt2-124m")
    p.add_argument("--compile-backend", default="inductor")
    p.add_argument("--compile-mode", default="", help="torch.compile mode (e.g. max-autotune-no-cudagraphs)")
    p.add_argument("--batch", default="gpt2-124m=16,gpt-1.3b=8,tiny=2", help="micro-batch per model (name=N)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per timed block")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2, help="timed blocks per contender (ABBA order)")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="dense bf16 peak (0: look the device up)")
    p.add_argument("--out", default="bench-out")
    p.add_argument("--stem", default="speed")
    args = p.parse_args(argv)
    if args.tiny:  # the tiny sizes, where the command line left the defaults
        defaults = vars(p.parse_args([]))
        for key, value in dict(models="tiny", compile_models="tiny", steps=2, warmup=1, rounds=2).items():
            if getattr(args, key) == defaults[key]:
                setattr(args, key, value)
    return args


def _timed_block(
    trainer: Trainer, shape: GPTShape, batch: int, steps: int, first: int, device: torch.device
) -> tuple[float, list[float]]:
    """Seconds of ``steps`` optimizer steps (device events on CUDA, the host clock otherwise) and their losses."""
    losses: list[torch.Tensor] = []
    batches = [random_batch(shape, batch, first + i, device) for i in range(steps)]
    if device.type == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for x, y in batches:
            losses.append(trainer.train_step(x, y))
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
    else:
        t0 = time.perf_counter()
        for x, y in batches:
            losses.append(trainer.train_step(x, y))
        seconds = time.perf_counter() - t0
    return seconds, [float(v) for v in losses]


def _fits_together(shape: GPTShape, n: int, device: torch.device) -> bool:
    if device.type != "cuda":
        return True
    return 16 * shape.parameters * n < 0.5 * torch.cuda.mem_get_info(device)[1]


def run_model(
    args: argparse.Namespace, model: str, names: list[str], device: torch.device
) -> list[dict[str, Any]]:
    """Every contender on ``model``: block seconds per round, peak device memory, losses."""
    shape, batch = SHAPES[model], args.batch[model]
    compile_options = {
        "backend": args.compile_backend,
        **({"mode": args.compile_mode} if args.compile_mode else {}),
    }
    together = _fits_together(shape, len(names), device)
    blocks: dict[str, list[float]] = {n: [] for n in names}
    losses: dict[str, list[float]] = {n: [] for n in names}
    peak: dict[str, int | None] = dict.fromkeys(names)
    build_s: dict[str, float] = {}
    built: dict[str, Trainer] = {}
    cursor = dict.fromkeys(names, 0)

    reset_device_peak(device)

    def get(name: str) -> Trainer:
        if name not in built:
            if not together:
                reset_device_peak(device)
            t0 = time.perf_counter()
            built[name] = build_trainer(name, shape, device, compile_options=compile_options)
            _timed_block(
                built[name], shape, batch, args.warmup, 10_000, device
            )  # first steps: state, compile
            build_s[name] = time.perf_counter() - t0
        return built[name]

    def release(name: str) -> None:
        if not together:
            peak[name] = device_memory(device)["peak_allocated"]
            built.pop(name, None)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()

    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            seconds, block_losses = _timed_block(get(name), shape, batch, args.steps, cursor[name], device)
            cursor[name] += args.steps
            blocks[name].append(seconds)
            losses[name] += block_losses
            release(name)
            print(
                f"  {model} {name}: {args.steps * batch * shape.seq_len / seconds:,.0f} tokens/s", flush=True
            )
    if together:
        peak = dict.fromkeys(names, device_memory(device)["peak_allocated"])  # all alive at once: their sum
    built.clear()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    rows = []
    for name in names:
        seconds = statistics.median(blocks[name])
        tokens_per_s = args.steps * batch * shape.seq_len / seconds
        rows.append(
            {
                "model": model,
                "contender": name,
                "what": CONTENDERS[name].what,
                "parameters": shape.parameters,
                "batch": batch,
                "seq_len": shape.seq_len,
                "ms_per_step": 1e3 * seconds / args.steps,
                "tokens_per_s": tokens_per_s,
                "block_s": blocks[name],
                "build_and_warmup_s": build_s.get(name),
                "model_tflops": model_tflops(tokens_per_s, shape.flops_per_token),
                "colossalai_tflops": colossalai_tflops(tokens_per_s, shape.parameters),
                "peak_device_bytes": peak[name],
                "built_together": together,
                "losses_finite": all(math.isfinite(v) for v in losses[name]),
                "last_loss": losses[name][-1],
            }
        )
    return rows


def _judge(rows: list[dict[str, Any]], peak: float | None) -> None:
    by = {(r["model"], r["contender"]): r for r in rows}
    for r in rows:
        r["mfu"] = mfu(r["tokens_per_s"], SHAPES[r["model"]].flops_per_token, peak)
        base = by.get((r["model"], BASELINE[r["contender"]]))
        r["ratio_to_loop"] = r["tokens_per_s"] / base["tokens_per_s"] if base else None
        r["baseline"] = BASELINE[r["contender"]]
        r["within_3pct"] = (
            None
            if r["ratio_to_loop"] is None or r["baseline"] == r["contender"]
            else r["ratio_to_loop"] >= GOAL_RATIO
        )


def _plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    labels = [f"{r['model']}\n{r['contender']}" for r in rows]
    left.bar(labels, [r["ratio_to_loop"] or 0 for r in rows], color="tab:blue")
    left.axhline(1.0, color="black", lw=0.8)
    left.axhline(GOAL_RATIO, color="tab:red", ls="--", lw=0.8, label="0.97 (within 3 %)")
    left.set_ylabel("tokens/s relative to the plain loop")
    left.legend(fontsize=8)
    with_mfu = any(r["mfu"] is not None for r in rows)
    values = [100 * (r["mfu"] or 0) for r in rows] if with_mfu else [r["model_tflops"] for r in rows]
    right.bar(labels, values, color="tab:green")
    for i, r in enumerate(rows):
        right.text(
            i,
            values[i],
            f"{r['colossalai_tflops']:.0f}" if with_mfu else "",
            ha="center",
            va="bottom",
            fontsize=7,
        )
    if with_mfu:
        right.axhline(100 * GOAL_MFU_124M, color="tab:red", ls="--", lw=0.8, label="30 % (124 M goal)")
        right.legend(fontsize=8)
    right.set_ylabel("MFU % (labels: ColossalAI's 8P TFLOPS)" if with_mfu else "model TFLOPS (no peak known)")
    for ax in (left, right):
        ax.tick_params(axis="x", labelsize=7, rotation=30)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "bench_speed: cannot run here: no CUDA device (torch.cuda.is_available() is False); "
            "use --device cpu --tiny to check the bench",
            file=sys.stderr,
        )
        return 2
    device = torch.device(args.device)
    models = [m for m in args.models.split(",") if m]
    args.batch = {k: int(v) for k, v in (p.split("=", 1) for p in args.batch.split(",") if p)}
    unknown = sorted({m for m in models if m not in SHAPES or m not in args.batch})
    if unknown:
        raise SystemExit(f"--models/--batch: {unknown} needs a shape in {sorted(SHAPES)} and a --batch entry")
    names = [n for n in args.contenders.split(",") if n]
    if "torch_loop" not in names or sorted(set(names) - set(EAGER)):
        raise SystemExit(f"--contenders: torch_loop and any of {EAGER}")
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    peak, product = (
        (args.peak_tflops, "--peak-tflops") if args.peak_tflops > 0 else peak_bf16_tflops(device_name)
    )
    out = Path(args.out)
    info = _machine.machine_info()
    info["gpu"], info["torch_cuda"] = device_name, torch.version.cuda
    payload: dict[str, Any] = {
        "machine": info,
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "peak_bf16_tflops": peak,
        "peak_from": product,
        "goals": {"ratio_to_loop": GOAL_RATIO, "mfu_124m": GOAL_MFU_124M},
        "rows": [],
    }
    torch.backends.cuda.matmul.allow_tf32 = True  # what a training loop sets; bf16 matmuls are unaffected
    for model in models:
        compiled = list(COMPILED) if args.compile and model in args.compile_models.split(",") else []
        payload["rows"] += run_model(args, model, names + compiled, device)
        _judge(payload["rows"], peak)
        _report.save_json(out / f"{args.stem}.json", payload)
    print(
        _report.format_table(
            payload["rows"],
            [
                ("model", "model", "s"),
                ("contender", "contender", "s"),
                ("tokens_per_s", "tokens/s", ",.0f"),
                ("ratio_to_loop", "x loop", ".3f"),
                ("mfu", "MFU", ".1%"),
                ("model_tflops", "TFLOPS", ".1f"),
                ("colossalai_tflops", "8P TFLOPS", ".1f"),
                ("ms_per_step", "ms/step", ".1f"),
            ],
        )
    )
    title = (
        f"one {device_name or 'CPU'}: bf16, AdamW(fused); peak {peak or '-'} TFLOPS ({product or 'unknown device'}); "
        f"torch {torch.__version__}"
    )
    _plot(payload["rows"], out / f"{args.stem}.png", title)
    print(f"wrote {out / args.stem}.json and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
