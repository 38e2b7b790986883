# SPDX-License-Identifier: Apache-2.0
"""What :class:`Lamb` and :class:`Lars` share under ``torch.compile``.

Dynamo traces ``step()``; the step sees :func:`torch.compiler.is_compiling` and takes the compiled update
(:mod:`._compiled_lamb`, :mod:`._compiled_lars`) instead of the eager one. Dynamo runs the optimizer's
``_init_group(group, <empty lists>...)`` eagerly while tracing (state creation, checks, bucketing) and takes its
return value, the bucket plan, as a constant. The update itself is whole-tensor ``torch._foreach_*`` and tensor
math: inductor fuses it into a few loops, so the eager path's cache-sized waves (made for the CPU's caches, one
kernel per op) are not needed. ``state["step"]`` becomes a float32 tensor on the parameter's device (torch.optim's
layout) and a tensor ``lr`` is read by the graph, so neither recompiles the step when it changes; an eager step
turns the steps back into ints (a later compiled step then recompiles once).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from stepforge.core import check_grad

from ._dtensor import is_dtensor

__all__ = ["as_int_steps", "as_step_tensor", "group_params", "lr_of"]


def as_step_tensor(step: Any, device: torch.device) -> torch.Tensor:
    """``state["step"]`` as a 0-dim float32 tensor on ``device`` (the compiled step reads and advances it)."""
    if (
        isinstance(step, torch.Tensor)
        and step.dtype == torch.float32
        and step.device == device
        and step.dim() == 0
    ):
        return step
    return torch.tensor(float(step), dtype=torch.float32, device=device)


def as_int_steps(states: list[dict[str, Any]]) -> None:
    """Turn tensor steps left by a compiled step back into ints (the eager update computes with ints)."""
    for state in states:
        step = state.get("step")
        if isinstance(step, torch.Tensor):
            state["step"] = int(step.item())


def lr_of(group: Mapping[str, Any]) -> Any:
    """The eager update's learning rate: a float (a tensor lr is read once per step; on a device that reads
    synchronises, so keep a tensor lr for eager steps on the CPU)."""
    lr = group["lr"]
    return float(lr) if isinstance(lr, torch.Tensor) else lr


def group_params(owner: str, group: Mapping[str, Any]) -> list[torch.Tensor]:
    """The group's parameters with a gradient (checked), refusing DTensors: a compiled step has no mesh
    reduction of the norms."""
    out = []
    for i, p in enumerate(group["params"]):
        if p.grad is None:
            continue
        if is_dtensor(p):
            raise RuntimeError(
                f"{owner}: parameter #{i} is a DTensor (FSDP2); its norms need a reduction over the mesh, which a "
                "compiled step() does not do. Call optimizer.step() outside torch.compile for sharded parameters."
            )
        check_grad(p, owner=owner)
        out.append(p)
    return out
