# SPDX-License-Identifier: Apache-2.0
"""How much slower is an fp16 training step than a bf16 (and fp32) one on this CPU, through the Booster?

The figure behind the one-time note of ``stepforge.core.precision.warn_slow_precision``. One
process, one thread, ``Booster(plugin=LowLevelZeroPlugin(stage=2, precision=p))``, a GPT-block-shaped MLP
(``--width`` wide, ``--layers`` deep, ``--rows`` tokens per step), AdamW. The precisions are interleaved round by
round and the median step time of each is printed with its ratio to bf16::

    python tools/repro/cpu_precision_step.py --rounds 5
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
import warnings

import torch
from torch import nn

from stepforge.strategy import Booster
from stepforge.zero import LowLevelZeroPlugin

PRECISIONS = ("fp16", "bf16", "fp32")


def _model(width: int, layers: int) -> nn.Module:
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)]
    return nn.Sequential(*blocks)


def _setup(precision: str, args: argparse.Namespace):
    torch.manual_seed(0)
    booster = Booster(plugin=LowLevelZeroPlugin(stage=2, precision=precision))
    model = _model(args.width, args.layers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the note this script measures for
        model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    x = torch.randn(args.rows, args.width)
    return booster, model, opt, x


def _step(booster, model, opt, x) -> float:
    start = time.perf_counter()
    loss = model(x).float().pow(2).mean()
    booster.backward(loss, opt)
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    runs = {p: _setup(p, args) for p in PRECISIONS}
    times: dict[str, list[float]] = {p: [] for p in PRECISIONS}
    for p in PRECISIONS:
        _step(*runs[p])  # warm-up
    for _ in range(args.rounds):
        for p in PRECISIONS:
            times[p] += [_step(*runs[p]) for _ in range(args.steps)]
    med = {p: statistics.median(t) for p, t in times.items()}
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, 1 thread, "
          f"load average {os.getloadavg()}, width {args.width} x {args.layers} layers, {args.rows} rows")  # fmt: skip
    for p in PRECISIONS:
        print(f"{p}: {med[p] * 1e3:8.2f} ms/step   {med[p] / med['bf16']:6.2f}x bf16")


if __name__ == "__main__":
    main()
