# SPDX-License-Identifier: Apache-2.0
"""Runtime services torch offers only privately: the autograd engine's end-of-backward callback
(``Variable._execution_engine.queue_callback``) and the default process group's key-value store
(``distributed_c10d._get_default_store``, for arrival barriers with a timeout, which ``barrier()`` lacks on
gloo)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["default_store", "queue_backward_callback"]


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the backward pass now running ends (call it from inside a backward hook)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def default_store() -> Any:
    """The key-value store (``torch.distributed.Store``) of the default process group."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()
