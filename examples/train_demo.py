# SPDX-License-Identifier: Apache-2.0
"""Train one small real model with stepforge's fused CPU optimizers and torch's AdamW, side by side.

    python examples/train_demo.py                     # ~20-40 s on 2 cores
    python examples/train_demo.py --epochs 5 --optimizers CPUAdam,AdamW --out demo-out
    python examples/train_demo.py --smoke             # 1 epoch on 256 samples: a few seconds

The data is scikit-learn's bundled handwritten digits (1 797 8x8 images, 10 classes; no download), split
80/20 with a fixed seed and standardised with the training statistics. The model is a pre-norm residual MLP
(``--width``, ``--depth``): with the defaults 2.1 M parameters in 102 tensors, the shape of a small transformer's
parameter list (many weights, biases and norm scales), so the optimizer step is a visible part of each
iteration.

Every optimizer starts from the same initial weights and sees the same batches in the same order. Each is built
through the registry, ``stepforge.core.build_optimizer(dict(type=..., lr=...), model)``, so any registered name
works (``FusedAdam``, ``Lamb``, ``SGD`` ...). ``AdamW`` is torch's ``AdamW(fused=True)``, the fastest torch path
on CPU. All share one learning-rate schedule (linear warm-up over the first epoch, cosine decay to zero). Only
``optimizer.step()`` is timed. ``--grads fresh`` (default) zeroes with ``zero_grad(set_to_none=True)`` as torch
does by default, so backward hands the optimizer new gradient tensors every step; ``--grads reuse`` zeroes them in
place (``set_to_none=False``), which lets a fused optimizer keep its cached pointer arrays.

Output: a progress bar per optimizer, a one-screen summary (final test accuracy and loss, optimizer-step time,
speed-up over torch's AdamW), ``<out>/train_demo.png`` (loss and accuracy curves) and ``<out>/train_demo.json``.
Exit status 0, or 2 when a requested optimizer is not installed (the message says which package to install).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn
from train_demo_model import ResidualMLP, load_digits_tensors
from train_demo_report import save_plot, summary_text
from train_demo_runner import BASELINE, RunResult, optimizer_key, train_one

__all__ = ["ResidualMLP", "RunResult", "load_digits_tensors", "main", "train_one"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Train a residual MLP on scikit-learn's digits with stepforge's fused CPU optimizers and "
        "torch's AdamW side by side.",
    )
    p.add_argument("--epochs", type=int, default=20, help="passes over the training set (default 20)")
    p.add_argument("--batch-size", type=int, default=64, help="default 64")
    p.add_argument(
        "--optimizers",
        default="CPUAdam,FusedLAMB,AdamW",
        help="comma-separated registry names (default CPUAdam,FusedLAMB,AdamW; AdamW is torch's, fused=True)",
    )
    p.add_argument(
        "--lr", type=float, default=None, help="one learning rate for all (default: per optimizer)"
    )
    p.add_argument("--width", type=int, default=256, help="hidden width (default 256)")
    p.add_argument("--depth", type=int, default=16, help="residual blocks (default 16; 6 tensors each)")
    p.add_argument(
        "--grads",
        choices=("fresh", "reuse"),
        default="fresh",
        help="fresh: zero_grad(set_to_none=True), backward allocates new gradients every step (torch's default); "
        "reuse: zero_grad(set_to_none=False), the same gradient tensors are zeroed and reused",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads", type=int, default=0, help="torch intra-op threads (default: all usable cores)"
    )
    p.add_argument("--out", default="demo-out", help="folder for train_demo.png / .json (default demo-out/)")
    p.add_argument("--smoke", action="store_true", help="1 epoch on 256 training samples (for tests)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.smoke:
        args.epochs = 1
    if args.epochs < 1 or args.batch_size < 1 or args.width < 1 or args.depth < 0:
        raise SystemExit("--epochs, --batch-size and --width must be >= 1, --depth >= 0")
    names = [n.strip() for n in args.optimizers.split(",") if n.strip()]
    if not names:
        raise SystemExit("--optimizers: give at least one name, e.g. CPUAdam,AdamW")
    if args.threads <= 0:
        args.threads = (
            len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        )
    torch.set_num_threads(args.threads)

    data = load_digits_tensors(args.seed, train_limit=256 if args.smoke else None)
    torch.manual_seed(args.seed)
    base = ResidualMLP(in_features=64, width=args.width, depth=args.depth, classes=10)
    n_params = sum(p.numel() for p in base.parameters())
    n_tensors = sum(1 for _ in base.parameters())
    steps_per_epoch = math.ceil(data[0].shape[0] / args.batch_size)
    print(
        f"digits: {data[0].shape[0]} train / {data[2].shape[0]} test images; model: residual MLP "
        f"64->{args.width}x{args.depth} blocks->10, {n_params / 1e6:.2f} M parameters in {n_tensors} tensors; "
        f"{args.epochs} epochs x {steps_per_epoch} steps; {args.threads} threads; grads {args.grads}; "
        f"torch {torch.__version__}"
    )

    results: list[RunResult] = []
    models: dict[str, nn.Module] = {}
    for name in names:
        result, model = train_one(
            name,
            base,
            data,
            epochs=args.epochs,
            batch_size=args.batch_size,
            seed=args.seed,
            lr=args.lr,
            progress=not args.no_progress,
            set_to_none=args.grads == "fresh",
        )
        results.append(result)
        if model is not None:
            models[name] = model
        else:
            print(f"NOT RUN {name}: {result.error}", file=sys.stderr)

    # CPUAdam/FusedAdam follow torch's fused AdamW operation order: same init + same data => same weights.
    identical: dict[str, bool] = {}
    ref = next((m for n, m in models.items() if optimizer_key(n) == optimizer_key(BASELINE)), None)
    ref_result = next(
        (r for r in results if optimizer_key(r.name) == optimizer_key(BASELINE) and r.error is None), None
    )
    for r in results:
        if (
            ref is None
            or ref_result is None
            or r.error is not None
            or optimizer_key(r.name) not in ("cpuadam", "fusedadam")
        ):
            continue
        if r.config.get("lr") == ref_result.config.get("lr"):
            identical[r.name] = all(
                torch.equal(a, b) for a, b in zip(models[r.name].parameters(), ref.parameters(), strict=True)
            )

    print()
    print(summary_text(results, identical=identical))
    out = Path(args.out)
    title = (
        f"digits, residual MLP {n_params / 1e6:.2f} M params / {n_tensors} tensors, batch {args.batch_size}, "
        f"{args.threads} threads, torch {torch.__version__}"
    )
    if any(r.error is None for r in results):
        png = save_plot(out / "train_demo.png", results, steps_per_epoch, title)
        print(f"wrote {png}")
    out.mkdir(parents=True, exist_ok=True)
    payload = {
        "args": vars(args),
        "parameters": n_params,
        "tensors": n_tensors,
        "torch": torch.__version__,
        "bit_identical_to_adamw": identical,
        "results": [asdict(r) | {"median_step_ms": r.median_step_ms} for r in results],
    }
    (out / "train_demo.json").write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {out / 'train_demo.json'}")
    return 2 if any(r.error is not None for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
