# SPDX-License-Identifier: Apache-2.0
"""Cases shared by the gradient-accumulation tests: a small regression model, its data, the big-batch reference
and ColossalAI's training-loop order.

Accumulating ``k`` micro-batches must give the step that one big batch (their concatenation) gives; every
reference here is that big-batch step, computed with plain torch and no accumulation code.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from .models import assert_params_close, mse
from .models import snapshot as param_copies

__all__ = [
    "IN_FEATURES",
    "assert_params_close",
    "big_batch_reference",
    "mse",
    "param_copies",
    "regression_data",
    "regression_dataset",
    "split_batches",
    "tiny_mlp",
    "train_colossalai_order",
]

#: features of :func:`tiny_mlp`'s input (``x`` is ``(n, IN_FEATURES)``, ``y`` is ``(n, 1)``)
IN_FEATURES = 4

Batch = tuple[torch.Tensor, torch.Tensor]


def tiny_mlp(seed: int = 0) -> nn.Sequential:
    """``Linear(4, 8) -> Tanh -> Linear(8, 1)`` in float32, initialised after ``torch.manual_seed(seed)``.

    The same ``seed`` gives the same weights, so a run under test and its reference start equal.
    """
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN_FEATURES, 8), nn.Tanh(), nn.Linear(8, 1))


def regression_data(n: int, seed: int = 1) -> Batch:
    """``n`` samples: ``x`` of shape ``(n, 4)`` and ``y`` of shape ``(n, 1)``, float32 from ``randn``.

    A private generator seeded with ``seed`` draws them (the global RNG is left alone).
    """
    if n < 1:
        raise ValueError(f"regression_data: n must be >= 1 (the number of samples), got {n!r}.")
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, IN_FEATURES, generator=gen), torch.randn(n, 1, generator=gen)


def regression_dataset(n: int, seed: int = 1) -> TensorDataset:
    """:func:`regression_data` as a ``TensorDataset`` of ``(x_i, y_i)`` pairs."""
    return TensorDataset(*regression_data(n, seed))


def split_batches(x: torch.Tensor, y: torch.Tensor, sizes: Sequence[int]) -> list[Batch]:
    """Consecutive micro-batches ``(x[a:b], y[a:b])`` of the given sizes (their sum must not exceed ``len(x)``)."""
    if sum(sizes) > len(x):
        raise ValueError(f"split_batches: sizes sum to {sum(sizes)} but there are only {len(x)} samples.")
    out, start = [], 0
    for size in sizes:
        out.append((x[start : start + size], y[start : start + size]))
        start += size
    return out


def big_batch_reference(
    windows: Iterable[Sequence[Batch]],
    *,
    lr: float = 0.1,
    optim: Callable[..., torch.optim.Optimizer] = torch.optim.SGD,
    clip: Callable[[list[nn.Parameter]], Any] | None = None,
    model_seed: int = 0,
    **optim_kwargs: Any,
) -> list[torch.Tensor]:
    """The parameters after one ``optim`` step per window on the concatenation of its micro-batches.

    Args:
        windows: each window a sequence of ``(x, y)`` micro-batches; the window's loss is the :func:`mse` of
            their concatenation (the mean over every sample of the window).
        lr, optim, optim_kwargs: the optimizer (``momentum=0.9`` shows a wrong step timing).
        clip: called with the parameters between backward and step (e.g. ``clip_grad_norm_``).
        model_seed: the :func:`tiny_mlp` seed (the run under test must start from the same one).
    """
    model = tiny_mlp(model_seed)
    opt = optim(model.parameters(), lr=lr, **optim_kwargs)
    for window in windows:
        opt.zero_grad()
        mse(model, torch.cat([x for x, _ in window]), torch.cat([y for _, y in window])).backward()
        if clip is not None:
            clip(list(model.parameters()))
        opt.step()
    return param_copies(model)


def train_colossalai_order(
    loader: Iterable[Batch],
    model: nn.Module,
    optim: Any,
    sched: Any = None,
    handlers: Sequence[Any] = (),
    epochs: int = 1,
) -> None:
    """ColossalAI's engine order per batch: ``zero_grad``, forward and ``backward`` inside ``optim_context()``,
    every handler's ``handle_gradient()``, ``step``, then ``sched.step()``."""
    for _ in range(epochs):
        for x, y in loader:
            optim.zero_grad()
            with optim.optim_context():
                optim.backward(mse(model, x, y))
            for handler in handlers:
                handler.handle_gradient()
            optim.step()
            if sched is not None:
                sched.step()
