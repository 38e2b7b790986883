# SPDX-License-Identifier: Apache-2.0
"""What ``train_demo.py`` prints and draws: the one-screen summary table and the loss / accuracy plot."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path

from train_demo_runner import BASELINE, RunResult, optimizer_key

__all__ = ["save_plot", "summary_text"]


def _label(r: RunResult) -> str:
    if optimizer_key(r.name) in ("adamw", "adam", "sgd") and r.config.get("fused"):
        return f"{r.name} (torch, fused)"
    return r.name


def summary_text(results: Sequence[RunResult], *, identical: dict[str, bool] | None = None) -> str:
    """The one-screen summary table."""
    ok = [r for r in results if r.error is None]
    base = next((r for r in ok if optimizer_key(r.name) == optimizer_key(BASELINE)), None)
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
