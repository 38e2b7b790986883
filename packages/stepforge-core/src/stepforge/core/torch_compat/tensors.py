# SPDX-License-Identifier: Apache-2.0
"""Tensor internals: DTensor's local shard as the tensor itself (``DTensor._local_tensor``), the tensor a
view was taken from (``Tensor._base``) and a tensor subclass without storage of its own
(``Tensor._make_wrapper_subclass``)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
from torch import nn

from .errors import private_changed

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["dtensor_local", "is_dtensor", "make_wrapper_subclass", "view_base"]

_DTENSOR_TYPE: type | None = None
_PLAIN_TENSOR = torch.Tensor
_PARAMETER = nn.Parameter


def _dtensor_type() -> type | None:
    # No DTensor exists before torch.distributed.tensor is imported: look it up only once it is, so that
    # optimizers never pay for importing torch.distributed.tensor themselves.
    global _DTENSOR_TYPE
    if _DTENSOR_TYPE is None:
        module = sys.modules.get("torch.distributed.tensor")
        _DTENSOR_TYPE = None if module is None else vars(module).get("DTensor")
    return _DTENSOR_TYPE


def is_dtensor(t: Any) -> TypeGuard[DTensor]:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (an FSDP2 parameter or gradient)."""
    cls = type(t)
    if cls is _PLAIN_TENSOR or cls is _PARAMETER:  # the common case first: optimizers ask per tensor per step
        return False
    dtensor = _DTENSOR_TYPE if _DTENSOR_TYPE is not None else _dtensor_type()
    return dtensor is not None and isinstance(t, dtensor)


def dtensor_local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor as the tensor itself (same object every call, same storage), else ``t``.

    Unlike ``DTensor.to_local()`` this creates no view and no autograd node: in-place updates of the result
    update the DTensor.
    """
    cls = type(t)
    if cls is _PLAIN_TENSOR or cls is _PARAMETER or not is_dtensor(t):
        return t
    try:
        return t._local_tensor
    except AttributeError as error:  # pragma: no cover - only on a torch that changed DTensor
        raise private_changed("DTensor._local_tensor", error) from error


def view_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``t`` is a view of (``None`` when ``t`` is not a view)."""
    return t._base


def make_wrapper_subclass(
    cls: type[torch.Tensor], shape: torch.Size, *, dtype: torch.dtype, device: torch.device
) -> Any:
    """A new ``cls`` instance of ``shape`` holding no data of its own (what DTensor is built on): the subclass
    keeps its data in attributes and implements the operations it supports itself."""
    return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=False)
