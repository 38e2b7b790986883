# SPDX-License-Identifier: Apache-2.0
""":class:`Lars` under ``torch.compile``: ``_init_group`` (run eagerly by dynamo) and the traced update.

The math is the eager update's (:class:`~._lars.Lars` docstring) on whole tensors. A momentum buffer created
while dynamo traces must take the update itself on the first compiled run (torch.optim.SGD's first step) and
the running average afterwards; which buffers are new is a float flag tensor per bucket that the graph reads
and then clears, so the first run and the later ones share one graph.
"""

from __future__ import annotations

from typing import Any

import torch

from ._base import math_dtype_of
from ._compiled import group_params
from ._multi_tensor import bucket_key

__all__ = ["lars_compiled_step", "lars_init_group"]


def lars_init_group(
    opt: Any,
    group: dict[str, Any],
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    bufs: list[torch.Tensor],
    extras: list[torch.Tensor],
) -> tuple[tuple[int, int, bool, int], ...]:
    """Fill the lists bucket by bucket (momentum buffers created as zeros where missing); returns each bucket's
    ``(start, stop, adapt, first_flags_index)`` (``-1``: no new buffer; the flags tensor is in ``extras``)."""
    opt._groups.revalidate(opt.param_groups)
    exclude = opt.exclude_from_adaptation
    momentum = group["momentum"] != 0
    by_key: dict[Any, list[tuple[torch.Tensor, bool]]] = {}
    for p in group_params(opt.OWNER, group):
        adapt = bool(group["lars"]) and not (exclude is not None and exclude(p))
        fresh = False
        state = opt.state[p]
        if momentum and "momentum_buffer" not in state:
            dtype = math_dtype_of(p.dtype)
            state["momentum_buffer"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.contiguous_format)
            fresh = True
        by_key.setdefault((*bucket_key(p, p.grad), adapt), []).append((p, fresh))  # type: ignore[arg-type]
    keep = opt._compile_first_flags
    keep.pop(id(group), None)
    plan = []
    for key, entries in by_key.items():
        start = len(params)
        for p, _fresh in entries:
            params.append(p)
            grads.append(p.grad)  # type: ignore[arg-type]
            if momentum:
                bufs.append(opt.state[p]["momentum_buffer"])
        first = -1
        if any(fresh for _p, fresh in entries):
            flags = torch.tensor([float(f) for _p, f in entries], device=entries[0][0].device)
            keep.setdefault(id(group), []).append(flags)  # kept alive here: the graph reads it
            first = len(extras)
            extras.append(flags)
        plan.append((start, len(params), bool(key[-1]), first))
    return tuple(plan)


def lars_compiled_step(opt: Any) -> None:
    """The traced update of every group."""
    for group in opt.param_groups:
        params: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        bufs: list[torch.Tensor] = []
        extras: list[torch.Tensor] = []
        plan = opt._init_group(group, params, grads, bufs, extras)
        for start, stop, adapt, first in plan:
            flags = extras[first] if first >= 0 else None
            b = bufs[start:stop] if bufs else []
            _update(group, params[start:stop], grads[start:stop], b, adapt, flags)


def _update(
    group: dict[str, Any],
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    bufs: list[torch.Tensor],
    adapt: bool,
    first: torch.Tensor | None,
) -> None:
    mdtype = math_dtype_of(params[0].dtype)
    lr, mu, damp, nesterov = group["lr"], group["momentum"], group["dampening"], group["nesterov"]
    wd = group["weight_decay"] if group["lars"] else 0.0
    eeta, eps, clip = group["eeta"], group["epsilon"], group["grad_clip"]
    p32 = [p.to(mdtype) for p in params]
    d = [g.to(mdtype) for g in grads]  # read only: every op on d below is out of place
    coef = None
    if adapt:
        w = torch.stack(list(torch._foreach_norm(p32, 2, dtype=mdtype)))
        n = torch.stack(list(torch._foreach_norm(d, 2, dtype=mdtype)))
        ratio = torch.where((w > 0) & (n > 0), eeta * w / (n + wd * w + eps), torch.ones_like(w))
        if group["trust_clip"] is not None:
            low, high = group["trust_clip"]
            if low is not None or high is not None:
                ratio = ratio.clamp(min=low, max=high)
        coef = ratio * -lr
    if group["maximize"]:
        d = list(torch._foreach_mul(d, -1.0))
    if wd != 0:
        d = list(torch._foreach_add(d, p32, alpha=wd))
    if clip is not None:
        d = [x.clamp(-clip, clip) for x in d]
    step = d
    if mu != 0:
        new = [b * mu + x * (1.0 - damp) for b, x in zip(bufs, d, strict=True)]
        if first is not None:
            new = [torch.where(first[i] != 0, d[i], new[i]) for i in range(len(d))]
            first.zero_()
        torch._foreach_copy_(bufs, new)
        step = list(torch._foreach_add(d, bufs, alpha=mu)) if nesterov else bufs
    for i, p in enumerate(params):
        scale = coef[i] if coef is not None else -lr
        p.copy_(p32[i] + step[i] * scale)
