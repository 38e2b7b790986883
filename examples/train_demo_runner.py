# SPDX-License-Identifier: Apache-2.0
"""Training one optimizer in ``train_demo.py``: per-optimizer defaults, the shared schedule and batch order,
every ``optimizer.step()`` timed, the result of a run.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["BASELINE", "DEFAULTS", "RunResult", "evaluate", "optimizer_key", "train_one"]

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


def optimizer_key(name: str) -> str:
    """``name`` as the registry compares it: case-, '-' and '_'-insensitive."""
    return name.strip().lower().replace("-", "").replace("_", "")


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

    cfg: dict[str, Any] = {"type": name, **DEFAULTS.get(optimizer_key(name), {"lr": 1e-3})}
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
