# SPDX-License-Identifier: Apache-2.0
"""The optimizers users hold, as factories of the parameters (``--optimizer _optimizer_cases:adam`` on the
command line), and the bias-free model they are estimated for (``Muon`` takes 2-D parameters only)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

import stepforge.fused as fused
import stepforge.optim as optim

Params = Iterable[Any]


def model() -> nn.Module:
    """Two bias-free linear layers (2-D parameters of two shapes)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32, bias=False), nn.Tanh(), nn.Linear(32, 8, bias=False))


#: optimizers whose state the estimate reads: every torch.optim class that steps without a closure on dense
#: gradients, and every stepforge optimizer
READABLE: dict[str, Callable[[Params], torch.optim.Optimizer]] = {
    "adam": lambda p: torch.optim.Adam(p, lr=1e-3),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3),
    "adam_amsgrad": lambda p: torch.optim.Adam(p, lr=1e-3, amsgrad=True),
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "rmsprop": lambda p: torch.optim.RMSprop(p, momentum=0.9, centered=True),
    "adagrad": lambda p: torch.optim.Adagrad(p),
    "adadelta": lambda p: torch.optim.Adadelta(p),
    "adamax": lambda p: torch.optim.Adamax(p),
    "nadam": lambda p: torch.optim.NAdam(p),
    "radam": lambda p: torch.optim.RAdam(p),
    "asgd": lambda p: torch.optim.ASGD(p),
    "rprop": lambda p: torch.optim.Rprop(p),
    "muon": lambda p: torch.optim.Muon(p),
    "fused_adam": lambda p: fused.FusedAdam(p, lr=1e-3),
    "fused_lamb": lambda p: fused.FusedLAMB(p, lr=1e-3),
    "fused_sgd": lambda p: fused.FusedSGD(p, lr=0.1, momentum=0.9),
    "cpu_adam": lambda p: fused.CPUAdam(p, lr=1e-3),
    "hybrid_adam": lambda p: fused.HybridAdam(p, lr=1e-3),
    "lamb": lambda p: optim.Lamb(p, lr=1e-3),
    "lars": lambda p: optim.Lars(
        p, lr=0.1, momentum=0.9, exclude_from_adaptation=optim.Lars.exclude_bias_and_norm
    ),
}
#: optimizers whose state the estimate cannot read, and the words of the reason in its error
UNREADABLE: dict[str, tuple[Callable[[Params], torch.optim.Optimizer], str]] = {
    "lbfgs": (lambda p: torch.optim.LBFGS(p), "closure"),
    "sparse_adam": (lambda p: torch.optim.SparseAdam(p), "dense gradients"),
    "adafactor": (lambda p: torch.optim.Adafactor(p), "depends on the parameter's shape"),
}
# each factory is also a name of this module, for the command line's --optimizer _optimizer_cases:<name>
globals().update(READABLE)
globals().update({name: make for name, (make, _) in UNREADABLE.items()})
