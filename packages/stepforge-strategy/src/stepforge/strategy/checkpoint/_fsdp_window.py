# SPDX-License-Identifier: Apache-2.0
"""The unsharded gradients FSDP2 accumulates inside a no-sync accumulation window: read them for a save, put
them back on resume.

Under ``set_requires_gradient_sync(False)`` FSDP2 keeps each micro-batch's gradient on its *unsharded* parameter
and reduce-scatters the sum only in the first synchronised backward; no public torch API exposes these tensors
(:mod:`stepforge.core.torch_compat` reaches them). Restore writes ``unsharded_accumulated_grad``: FSDP2's
post-backward adds the next micro-batch's gradient into it (saved + new, the operands autograd adds in the
uninterrupted run), so the resumed window sums exactly as the uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from stepforge.core.torch_compat import (
    fsdp2_param_shape,
    fsdp2_params,
    fsdp2_pending_grad,
    is_dtensor,
    set_fsdp2_pending_grad,
)

__all__ = ["fsdp_pending_grads", "set_fsdp_pending_grads"]


def fsdp_pending_grads(model: nn.Module) -> list[torch.Tensor | None]:
    """This rank's not yet reduce-scattered (unsharded) gradients of every FSDP2 parameter, cloned to CPU."""
    out: list[torch.Tensor | None] = []
    for fp in fsdp2_params(model):
        grad = fsdp2_pending_grad(fp)
        if grad is not None:
            grad = (grad.to_local() if is_dtensor(grad) else grad).detach().to("cpu", copy=True)
        out.append(grad)
    return out


def set_fsdp_pending_grads(model: nn.Module, grads: Sequence[torch.Tensor | None]) -> None:
    """Put gradients saved by :func:`fsdp_pending_grads` back, for the next backward to accumulate into."""
    params = list(fsdp2_params(model))
    if len(params) != len(grads):
        raise ValueError(
            f"the checkpoint holds {len(grads)} pending FSDP2 gradients, the model has {len(params)} FSDP2 "
            "parameters: resume the same model and plugin, or save at a window boundary"
        )
    for fp, grad in zip(params, grads, strict=True):
        if grad is not None and tuple(grad.shape) != tuple(fsdp2_param_shape(fp)):
            raise ValueError(
                f"saved pending FSDP2 gradient of shape {tuple(grad.shape)} for a parameter of shape "
                f"{tuple(fsdp2_param_shape(fp))}: resume the same model, or save at a window boundary"
            )
        # the saved dtype is the one FSDP2 accumulated in (param_dtype, or reduce_dtype after an upcast)
        set_fsdp2_pending_grad(fp, grad)
