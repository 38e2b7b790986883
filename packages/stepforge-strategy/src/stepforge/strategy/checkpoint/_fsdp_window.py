# SPDX-License-Identifier: Apache-2.0
"""The unsharded gradients FSDP2 accumulates inside a no-sync accumulation window: read them for a save, put
them back on resume.

Why FSDP2 internals: under ``set_requires_gradient_sync(False)`` FSDP2 keeps each micro-batch's gradient on its
*unsharded* parameter (``FSDPParam._unsharded_param.grad``, or ``FSDPParam.unsharded_accumulated_grad`` when a
``reduce_dtype`` differs from the parameter dtype) and reduce-scatters the sum only in the first synchronised
backward. No public torch API exposes these tensors, so this module is the only place that touches them.

Restore writes ``unsharded_accumulated_grad``: FSDP2's post-backward adds the next micro-batch's gradient into it
(``accumulate_unsharded_grad_if_needed``: saved + new, the same operands autograd adds in the uninterrupted run)
and the synchronised backward reduce-scatters it, so the resumed window sums exactly as the uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["fsdp_pending_grads", "set_fsdp_pending_grads"]


def _fsdp_params(model: nn.Module) -> Iterator[Any]:
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group  # internal: see the module docstring
        if group is not None:
            yield from group.fsdp_params


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if hasattr(grad, "to_local") else grad


def fsdp_pending_grads(model: nn.Module) -> list[torch.Tensor | None]:
    """This rank's not yet reduce-scattered (unsharded) gradients of every FSDP2 parameter, cloned to CPU."""
    out: list[torch.Tensor | None] = []
    for fp in _fsdp_params(model):
        grad = fp.unsharded_accumulated_grad
        if grad is None and hasattr(fp, "_unsharded_param"):
            grad = fp._unsharded_param.grad
        out.append(None if grad is None else _local(grad).detach().to("cpu", copy=True))
    return out


def set_fsdp_pending_grads(model: nn.Module, grads: Sequence[torch.Tensor | None]) -> None:
    """Put gradients saved by :func:`fsdp_pending_grads` back, for the next backward to accumulate into."""
    params = list(_fsdp_params(model))
    if len(params) != len(grads):
        raise ValueError(
            f"the checkpoint holds {len(grads)} pending FSDP2 gradients, the model has {len(params)} FSDP2 "
            "parameters: resume the same model and plugin, or save at a window boundary"
        )
    for fp, grad in zip(params, grads, strict=True):
        if grad is None:
            fp.unsharded_accumulated_grad = None
            continue
        if tuple(grad.shape) != tuple(fp._orig_size):
            raise ValueError(
                f"saved pending FSDP2 gradient of shape {tuple(grad.shape)} for a parameter of shape "
                f"{tuple(fp._orig_size)}: resume the same model, or save at a window boundary"
            )
        # the saved dtype is the one FSDP2 accumulated in (param_dtype, or reduce_dtype after an upcast)
        fp.unsharded_accumulated_grad = grad.to(fp.device)
