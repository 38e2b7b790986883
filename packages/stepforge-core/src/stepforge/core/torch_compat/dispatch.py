# SPDX-License-Identifier: Apache-2.0
"""Recording a model's construction and giving its meta tensors memory (``stepforge.strategy.lazy``).

- :class:`DispatchMode`: ``torch.utils._python_dispatch.TorchDispatchMode``, which sees every ATen operation
  (a module's ``torch.empty``, ``nn.init.normal_``, ``arange``...) with its arguments;
- :func:`tree_flatten` / :func:`tree_unflatten`: ``torch.utils._pytree``, how such an operation's nested arguments
  are taken apart and put back;
- :func:`storage_id`: a tensor's storage identity (``UntypedStorage._cdata``, the storage's address), shared by
  its views, ``.data`` and an ``nn.Parameter`` around it: meta tensors have no data pointer to tell them apart;
- :func:`apply_in_place`: ``nn.Module._apply`` (what ``to``/``to_empty`` call, and what FSDP2 hooks to re-pad its
  shards) with the parameter objects kept (``torch.__future__``'s swap), so tied weights stay one parameter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode as DispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["DispatchMode", "apply_in_place", "storage_id", "tree_flatten", "tree_unflatten"]


def storage_id(tensor: torch.Tensor) -> int:
    """The identity of ``tensor``'s storage (unique while the storage lives)."""
    return int(tensor.untyped_storage()._cdata)


def apply_in_place(model: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``model._apply(fn)`` with every parameter and buffer object kept (its contents swapped)."""
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        return model._apply(fn)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
