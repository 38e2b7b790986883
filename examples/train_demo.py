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
import copy
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["ResidualMLP", "RunResult", "load_digits_tensors", "main", "train_one"]

BASELINE = "AdamW"
# Per-optimizer defaults (keys compared case-, '-' and '_'-insensitively, like the registry). LAMB's layer-wise
# trust ratio makes lr a relative step per layer, so it wants a larger lr than Adam.
DEFAULTS: dict[str, dict[str, Any]] = {
    "cpuadam": dict(lr=1e-3, weight_decay=0.01),
    "hybridadam": dict(lr=1e-3, weight_decay=0.01),
    "fusedadam": dict(lr=1e-3, weight_decay=0.01),
    "adamw": dict(lr=1e-3, weight_decay=0.01, fused=True),
    "adam": dict(lr=1e-3, fused=True),
    "fusedlamb": dict(lr=5e-3, weight_decay=0.01),
    "lamb": dict(lr=5e-3, weight_decay=0.01),
    "fusedsgd": dict(lr=0.05, momentum=0.9, weight_decay=1e-4),
    "sgd": dict(lr=0.05, momentum=0.9, weight_decay=1e-4, fused=True),
}


def _key(name: str) -> str:
    return name.strip().lower().replace("-", "").replace("_", "")


# --------------------------------------------------------------------------------------------------------
# data and model
# --------------------------------------------------------------------------------------------------------
def load_digits_tensors(seed: int, *, train_limit: int | None = None) -> tuple[torch.Tensor, ...]:
    """scikit-learn's digits, split 80/20 (stratified) and standardised with the training statistics.

    Returns:
        ``x_train (N, 64) float32, y_train (N,) int64, x_test (M, 64) float32, y_test (M,) int64``.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x_tr, x_te, y_tr, y_te = train_test_split(
        data.data, data.target, test_size=0.2, random_state=seed, stratify=data.target
    )
    if train_limit is not None:
        x_tr, y_tr = x_tr[:train_limit], y_tr[:train_limit]
    mean, std = x_tr.mean(axis=0), x_tr.std(axis=0) + 1e-3  # some border pixels are always 0
    x_tr, x_te = (x_tr - mean) / std, (x_te - mean) / std
    as_x = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    as_y = lambda a: torch.tensor(a, dtype=torch.int64)  # noqa: E731
    return as_x(x_tr), as_y(y_tr), as_x(x_te), as_y(y_te)


class ResidualBlock(nn.Module):
    """``x + W2 gelu(W1 layernorm(x))`` on ``(batch, width)``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


class ResidualMLP(nn.Module):
    """Pre-norm residual MLP classifier: ``(batch, in_features) -> (batch, classes)`` logits."""

    def __init__(self, in_features: int = 64, width: int = 256, depth: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Linear(in_features, width)
        self.blocks = nn.Sequential(*(ResidualBlock(width) for _ in range(depth)))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.stem(x))))


# --------------------------------------------------------------------------------------------------------
# training
# --------------------------------------------------------------------------------------------------------
@dataclass
class RunResult:
    """What one optimizer's run produced."""

    name: str
    config: dict[str, Any]
    train_loss: list[float] = field(default_factory=list)  # per step
    test_loss: list[float] = field(default_factory=list)  # per epoch
    test_acc: list[float] = field(default_factory=list)  # per epoch
    step_ms: list[float] = field(default_factory=list)  # opt.step() wall time per step
    wall_s: float = 0.0
    error: str | None = None

    @property
    def median_step_ms(self) -> float:
        return statistics.median(self.step_ms) if self.step_ms else math.nan


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of ``model`` on ``(x, y)``."""
    model.eval()
    logits = model(x)
    model.train()
    return float(nn.functional.cross_entropy(logits, y)), float((logits.argmax(1) == y).float().mean())


def train_one(
    name: str,
    base_model: nn.Module,
    data: tuple[torch.Tensor, ...],
    *,
    epochs: int,
    batch_size: int,
    seed: int,
    lr: float | None,
    progress: bool,
    set_to_none: bool = True,
) -> tuple[RunResult, nn.Module | None]:
    """Train a copy of ``base_model`` with the optimizer registered as ``name``; time every ``opt.step()``."""
    from stepforge.core import build_optimizer
    from stepforge.core.errors import StepforgeError

    cfg: dict[str, Any] = {"type": name, **DEFAULTS.get(_key(name), {"lr": 1e-3})}
    if lr is not None:
        cfg["lr"] = lr
    result = RunResult(name=name, config=dict(cfg))
    model = copy.deepcopy(base_model)
    try:
        opt = build_optimizer(cfg, model)
    except (StepforgeError, ImportError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result, None

    x_tr, y_tr, x_te, y_te = data
    n = x_tr.shape[0]
    steps_per_epoch = math.ceil(n / batch_size)
    total = epochs * steps_per_epoch
    warmup = min(steps_per_epoch, max(1, total // 10))
    # linear warm-up over the first epoch, then cosine decay to zero: the same schedule for every optimizer
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (
            (s + 1) / warmup
            if s < warmup
            else 0.5 * (1 + math.cos(math.pi * (s - warmup) / (total - warmup)))
        ),
    )
    order = torch.Generator().manual_seed(seed)  # the same batches in the same order for every optimizer
    bar = _progress(total=epochs * steps_per_epoch, desc=f"{name:>10}", enabled=progress)
    t_start = time.perf_counter()
    for _ in range(epochs):
        perm = torch.randperm(n, generator=order)
        for i in range(steps_per_epoch):
            idx = perm[i * batch_size : (i + 1) * batch_size]
            loss = nn.functional.cross_entropy(model(x_tr[idx]), y_tr[idx])
            opt.zero_grad(set_to_none=set_to_none)
            loss.backward()
            t0 = time.perf_counter_ns()
            opt.step()
            result.step_ms.append((time.perf_counter_ns() - t0) / 1e6)
            sched.step()
            result.train_loss.append(float(loss.detach()))
            bar.update(1)
        test_loss, test_acc = evaluate(model, x_te, y_te)
        result.test_loss.append(test_loss)
        result.test_acc.append(test_acc)
        bar.set_postfix(loss=f"{result.train_loss[-1]:.3f}", test_acc=f"{100 * test_acc:.1f}%")
    bar.close()
    result.wall_s = time.perf_counter() - t_start
    return result, model


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def set_postfix(self, **kw: Any) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(*, total: int, desc: str, enabled: bool) -> Any:
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="step", leave=True, dynamic_ncols=True)


# --------------------------------------------------------------------------------------------------------
# reporting
# --------------------------------------------------------------------------------------------------------
def _label(r: RunResult) -> str:
    if _key(r.name) in ("adamw", "adam", "sgd") and r.config.get("fused"):
        return f"{r.name} (torch, fused)"
    return r.name


def summary_text(results: Sequence[RunResult], *, identical: dict[str, bool] | None = None) -> str:
    """The one-screen summary table."""
    ok = [r for r in results if r.error is None]
    base = next((r for r in ok if _key(r.name) == _key(BASELINE)), None)
    head = (
        f"{'optimizer':<22} {'lr':>7} {'test acc':>9} {'test loss':>10} {'train loss':>11} "
        f"{'step ms':>8} {'speed-up':>9} {'wall s':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in ok:
        speed = base.median_step_ms / r.median_step_ms if base is not None else math.nan
        tail = statistics.fmean(r.train_loss[-10:]) if r.train_loss else math.nan
        lines.append(
            f"{_label(r):<22} {r.config.get('lr', math.nan):>7.0e} {100 * r.test_acc[-1]:>8.1f}% "
            f"{r.test_loss[-1]:>10.4f} {tail:>11.4f} {r.median_step_ms:>8.3f} {speed:>8.2f}x {r.wall_s:>7.1f}"
        )
    lines.append(
        "step ms = median wall time of optimizer.step() alone; speed-up = AdamW's step ms / this one's; "
        "train loss = mean of the last 10 steps."
    )
    for name, same in (identical or {}).items():
        lines.append(
            f"{name} vs torch AdamW(fused=True): final weights bit-identical after the whole run: "
            f"{'yes' if same else 'no'}"
        )
    for r in results:
        if r.error is not None:
            lines.append(f"NOT RUN {r.name}: {r.error}")
    return "\n".join(lines)


def save_plot(path: Path, results: Sequence[RunResult], steps_per_epoch: int, title: str) -> Path:
    """Training loss per step (thin) and per epoch (thick), and test accuracy per epoch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = [("-", "o"), ("--", "s"), (":", "^"), ("-.", "D")]  # runs that coincide stay visible
    for i, r in enumerate(r for r in results if r.error is None):
        ls, marker = styles[i % len(styles)]
        (line,) = ax1.plot(r.train_loss, lw=0.6, alpha=0.3)
        epochs = len(r.test_acc)
        per_epoch = [
            statistics.fmean(r.train_loss[e * steps_per_epoch : (e + 1) * steps_per_epoch])
            for e in range(epochs)
        ]
        xs = [(e + 1) * steps_per_epoch for e in range(epochs)]
        ax1.plot(xs, per_epoch, color=line.get_color(), ls=ls, lw=2, label=f"{_label(r)} (epoch mean)")
        ax2.plot(
            range(1, epochs + 1),
            [100 * a for a in r.test_acc],
            ls=ls,
            marker=marker,
            markersize=4,
            color=line.get_color(),
            label=f"{_label(r)}: {100 * r.test_acc[-1]:.1f}%, step {r.median_step_ms:.2f} ms",
        )
    ax1.set_yscale("log")
    ax1.set_xlabel("step")
    ax1.set_ylabel("training loss (cross-entropy)")
    ax1.legend(fontsize=8)
    ax2.set_xlabel("epoch")
    ax2.xaxis.get_major_locator().set_params(integer=True)
    ax2.set_ylabel("test accuracy (%)")
    ax2.legend(fontsize=8, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------------------------------------
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
    ref = next((m for n, m in models.items() if _key(n) == _key(BASELINE)), None)
    ref_result = next((r for r in results if _key(r.name) == _key(BASELINE) and r.error is None), None)
    for r in results:
        if (
            ref is None
            or ref_result is None
            or r.error is not None
            or _key(r.name) not in ("cpuadam", "fusedadam")
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
