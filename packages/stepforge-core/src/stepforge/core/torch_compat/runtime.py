# SPDX-License-Identifier: Apache-2.0
"""Runtime services torch offers only privately: the autograd engine's end-of-backward callback, the default
process group's store (arrival barriers with a timeout, which ``barrier()`` lacks on gloo), and for
``stepforge.strategy.lazy`` (recording a model's construction, giving its meta tensors memory) the dispatch mode
that sees every ATen operation, ``torch.utils._pytree``, storage identity (meta tensors have no data pointer)
and ``nn.Module._apply`` (what ``to``/``to_empty`` call and FSDP2 hooks to re-pad its shards).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode as DispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = [
    "DispatchMode",
    "apply_in_place",
    "default_store",
    "queue_backward_callback",
    "storage_id",
    "tree_flatten",
    "tree_unflatten",
]


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the backward pass now running ends (call it from inside a backward hook)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def default_store() -> Any:
    """The key-value store (``torch.distributed.Store``) of the default process group."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


def storage_id(tensor: torch.Tensor) -> int:
    """The identity of ``tensor``'s storage (unique while the storage lives; shared by its views, ``.data`` and
    an ``nn.Parameter`` around it)."""
    return int(tensor.untyped_storage()._cdata)


def apply_in_place(model: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``model._apply(fn)`` with every parameter and buffer object kept (its contents swapped: tied weights stay
    one parameter)."""
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        return model._apply(fn)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
