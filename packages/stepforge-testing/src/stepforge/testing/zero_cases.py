# SPDX-License-Identifier: Apache-2.0
"""Shared cases of stepforge-zero's tests: small models, their data split over ranks, single-process
references and a counter of ``torch.distributed`` collectives.

The references follow DDP's arithmetic: with equal per-rank batch sizes, the mean loss over the *concatenated*
batch of all ranks has the gradient that the ranks' averaged gradients equal, so a sharded run on ``W`` ranks is
compared with one process training on the whole batch. For low-precision working parameters
:func:`reference_run` keeps fp32 masters by hand (copy the grad to fp32, step the fp32 copy, cast back), the
textbook mixed-precision recipe.

Example::

    model = make_model(dtype=torch.bfloat16)
    for x, y in micro_batches(step, accum, rank, world, torch.bfloat16): ...
    ref_model, ref_opt = reference_run("AdamW", steps=3, dtype=torch.bfloat16)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from stepforge.core import build_optimizer

__all__ = [
    "GLOBAL_BATCH",
    "IN",
    "HIDDEN",
    "OUT",
    "mlp",
    "regression_batch",
    "rank_rows",
    "make_model",
    "param_groups",
    "batch",
    "local_rows",
    "loss_fn",
    "micro_batches",
    "optimizer_cfg",
    "reference_run",
    "train_reference",
    "flat_params",
    "param_copies",
    "assert_all_close",
    "counting",
    "COLLECTIVE_NAMES",
]

GLOBAL_BATCH = 8
IN, HIDDEN, OUT = 7, 13, 5  # odd sizes: every parameter needs padding at 2 and 4 ranks


# -- generic pieces ---------------------------------------------------------------------------------------
def mlp(sizes: Sequence[int], *, seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    """``Linear(sizes[0], sizes[1]) -> Tanh -> Linear(sizes[1], sizes[2])`` initialised from ``seed``."""
    n_in, hidden, n_out = sizes
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(n_in, hidden), nn.Tanh(), nn.Linear(hidden, n_out)).to(dtype)


def regression_batch(seed: int, rows: int, n_in: int, n_out: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, y)`` of shapes ``(rows, n_in)``/``(rows, n_out)``, fp32 standard normal drawn from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, n_in, generator=gen), torch.randn(rows, n_out, generator=gen)


def rank_rows(rank: int, world: int, rows: int) -> slice:
    """Rank ``rank``'s equal share ``[r*rows/W, (r+1)*rows/W)`` of a global batch of ``rows`` rows."""
    if rows % world:
        raise ValueError(f"rank_rows: a global batch of {rows} rows does not split over {world} ranks")
    per = rows // world
    return slice(rank * per, (rank + 1) * per)


def train_reference(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    steps: Iterable[Sequence[tuple[torch.Tensor, torch.Tensor]]],
    *,
    max_norm: float = 0.0,
) -> list[torch.Tensor]:
    """One process: per step, zero the grads, backward the MSE of every micro-batch (losses summed), clip
    to ``max_norm`` with ``torch.nn.utils.clip_grad_norm_`` when > 0, step. Returns copies of the params."""
    for micro_batches_of_step in steps:
        optimizer.zero_grad()
        for x, y in micro_batches_of_step:
            nn.functional.mse_loss(model(x), y).backward()
        if max_norm:
            nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
    return param_copies(model)


def param_copies(model: nn.Module) -> list[torch.Tensor]:
    """Detached fp32 copies of ``model``'s parameters, in order."""
    return [p.detach().clone().float() for p in model.parameters()]


def flat_params(model: nn.Module) -> torch.Tensor:
    """Every parameter of ``model`` flattened into one fp32 vector."""
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


def assert_all_close(
    got: Sequence[torch.Tensor], want: Sequence[torch.Tensor], *, rtol: float, atol: float
) -> None:
    """``torch.testing.assert_close`` pairwise; the lists must have the same length."""
    assert len(got) == len(want), f"{len(got)} tensors, expected {len(want)}"
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol)


# -- the LowLevelZeroOptimizer case: two param groups, accumulation, low precision -------------------------
def make_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The ``IN -> HIDDEN -> OUT`` MLP (odd sizes, padded at 2 and 4 ranks)."""
    return mlp((IN, HIDDEN, OUT), seed=seed, dtype=dtype)


def param_groups(model: nn.Module) -> list[dict[str, Any]]:
    """Two groups: weights with weight decay, biases without (and a different lr)."""
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": weights}, {"params": biases, "weight_decay": 0.0, "lr": 0.02}]


def batch(step: int, micro: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """The global (all-rank) batch of one micro-batch; rank r takes :func:`local_rows`."""
    x, y = regression_batch(1000 + 17 * step + micro, GLOBAL_BATCH, IN, OUT)
    return x.to(dtype), y.to(dtype)


def local_rows(rank: int, world: int) -> slice:
    """Rank ``rank``'s rows of :func:`batch`."""
    return rank_rows(rank, world, GLOBAL_BATCH)


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean squared error of ``model(x)`` against ``y``."""
    loss: torch.Tensor = ((model(x) - y) ** 2).mean()
    return loss


def micro_batches(step: int, accum: int, rank: int, world: int, dtype: torch.dtype) -> Iterator[Any]:
    """Rank ``rank``'s share of each of the ``accum`` micro-batches of ``step``."""
    rows = local_rows(rank, world)
    for micro in range(accum):
        x, y = batch(step, micro, dtype)
        yield x[rows], y[rows]


def optimizer_cfg(name: str) -> dict[str, Any]:
    """A ``build_optimizer`` config for ``name`` (SGD with momentum; others lr 0.01, weight decay 0.01)."""
    if name == "SGD":
        return dict(type="SGD", lr=0.05, momentum=0.9, weight_decay=0.01)
    return dict(type=name, lr=0.01, weight_decay=0.01)


def reference_run(
    opt_name: str,
    steps: int,
    accum: int = 1,
    dtype: torch.dtype = torch.float32,
    max_norm: float = 0.0,
    start: int = 0,
    model: nn.Module | None = None,
    state: dict[str, Any] | None = None,
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The single-process run on the concatenated batch (fp32 masters by hand for low precision).

    ``accum`` micro-batches per step, each loss divided by ``accum``; ``start``/``model``/``state`` continue an
    earlier run (a resumed reference).
    """
    model = make_model(dtype=dtype) if model is None else model
    masters = [
        p.detach().float().clone().requires_grad_(p.dtype != torch.float32) for p in model.parameters()
    ]
    work: list[torch.Tensor] = list(model.parameters())
    if dtype == torch.float32:
        masters = work
    groups = param_groups(model)
    index = {id(p): i for i, p in enumerate(work)}
    master_groups = [{**g, "params": [masters[index[id(p)]] for p in g["params"]]} for g in groups]
    opt = build_optimizer(optimizer_cfg(opt_name), master_groups)
    if state is not None:
        opt.load_state_dict(state)
    for step in range(start, start + steps):
        for micro in range(accum):
            x, y = batch(step, micro, dtype)
            (loss_fn(model, x, y) / accum).backward()
        if dtype != torch.float32:
            for m, p in zip(masters, work, strict=True):
                assert p.grad is not None, "every parameter of the model gets a gradient"
                m.grad = p.grad.float()
                p.grad = None
        if max_norm:
            torch.nn.utils.clip_grad_norm_(masters, max_norm)
        opt.step()
        opt.zero_grad()
        if dtype != torch.float32:
            with torch.no_grad():
                for m, p in zip(masters, work, strict=True):
                    p.copy_(m.to(dtype))
    return model, opt


# -- counting collectives ---------------------------------------------------------------------------------
#: ``torch.distributed`` functions counted by :func:`counting`, by the name they are counted under (torch 2.13
#: renamed the tensor collectives ``*_single``; both spellings count under the old names)
COLLECTIVE_NAMES = {
    "reduce_scatter_tensor": "reduce_scatter_tensor",
    "reduce_scatter_single": "reduce_scatter_tensor",
    "all_gather_into_tensor": "all_gather_into_tensor",
    "all_gather_single": "all_gather_into_tensor",
    "all_reduce": "all_reduce",
    "broadcast": "broadcast",
    "all_gather": "all_gather",
    "all_to_all_single": "all_to_all_single",
}


@contextmanager
def counting() -> Iterator[Counter[str]]:
    """Count calls (``name``) and elements (``name.elements``) of the ``torch.distributed`` collectives made
    in the block, by wrapping the module's functions (code that looks them up at call time is seen)."""
    calls: Counter[str] = Counter()
    saved = {name: getattr(dist, name) for name in COLLECTIVE_NAMES if hasattr(dist, name)}

    def wrap(name: str, fn: Any) -> Any:
        def wrapper(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            calls[COLLECTIVE_NAMES[name]] += 1
            arg = args[0] if args and torch.is_tensor(args[0]) else tensor
            calls[COLLECTIVE_NAMES[name] + ".elements"] += arg.numel() if torch.is_tensor(arg) else 0
            return fn(tensor, *args, **kwargs)

        return wrapper

    for name, fn in saved.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
