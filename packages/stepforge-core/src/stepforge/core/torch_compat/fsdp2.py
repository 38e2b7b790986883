# SPDX-License-Identifier: Apache-2.0
"""FSDP2 internals: its module class wherever the installed torch keeps it, and the unsharded gradients FSDP2
holds inside a no-sync window (``FSDPModule._get_fsdp_state()._fsdp_param_group.fsdp_params``,
``FSDPParam._unsharded_param``, ``FSDPParam._orig_size``). No public API exposes the gradients kept by
``set_requires_gradient_sync(False)``; checkpoints inside an accumulation window need them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .errors import private_changed

__all__ = [
    "fsdp2_module_type",
    "fsdp2_modules",
    "fsdp2_param_shape",
    "fsdp2_params",
    "fsdp2_pending_grad",
    "set_fsdp2_pending_grad",
]


def fsdp2_module_type() -> type | None:
    """``FSDPModule`` (the class ``fully_shard`` mixes into a module), or ``None`` without FSDP2."""
    try:  # torch >= 2.6 exports it here
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - older torch
        try:
            from torch.distributed._composable.fsdp import FSDPModule
        except ImportError:
            return None
    return FSDPModule


def fsdp2_modules(target: Any) -> list[nn.Module]:
    """Every FSDP2 module in ``target`` (itself included), outermost first; ``[]`` for anything else."""
    fsdp_module = fsdp2_module_type()
    if fsdp_module is None or not isinstance(target, nn.Module):
        return []
    return [m for m in target.modules() if isinstance(m, fsdp_module)]


def fsdp2_params(model: nn.Module) -> Iterator[Any]:
    """Every ``FSDPParam`` (FSDP2's record of one sharded parameter) of every FSDP2 module of ``model``."""
    for module in fsdp2_modules(model):
        fsdp: Any = module  # an FSDPModule: its methods are not on nn.Module
        try:
            group = fsdp._get_fsdp_state()._fsdp_param_group
        except AttributeError as error:  # pragma: no cover - only on a torch that changed FSDP2
            raise private_changed("FSDPModule._get_fsdp_state()._fsdp_param_group", error) from error
        if group is not None:
            yield from group.fsdp_params


def fsdp2_param_shape(fsdp_param: Any) -> torch.Size:
    """The unsharded shape of an ``FSDPParam``."""
    try:
        size: torch.Size = fsdp_param._orig_size
        return size
    except AttributeError as error:  # pragma: no cover - only on a torch that changed FSDP2
        raise private_changed("FSDPParam._orig_size", error) from error


def fsdp2_pending_grad(fsdp_param: Any) -> torch.Tensor | None:
    """The unsharded gradient FSDP2 holds for ``fsdp_param`` inside a no-sync window (not reduce-scattered yet).

    ``FSDPParam.unsharded_accumulated_grad`` when a ``reduce_dtype`` differs from the parameter dtype, else the
    unsharded parameter's ``.grad``; ``None`` when there is none (the unsharded parameter may not exist yet).
    """
    grad: torch.Tensor | None = fsdp_param.unsharded_accumulated_grad
    if grad is None and hasattr(fsdp_param, "_unsharded_param"):
        grad = fsdp_param._unsharded_param.grad
    return grad


def set_fsdp2_pending_grad(fsdp_param: Any, grad: torch.Tensor | None) -> None:
    """Hand ``grad`` (unsharded, any device) to FSDP2 as the gradient accumulated so far for ``fsdp_param``: the
    next backward adds into it and the first synchronised one reduce-scatters the sum."""
    fsdp_param.unsharded_accumulated_grad = None if grad is None else grad.to(fsdp_param.device)
