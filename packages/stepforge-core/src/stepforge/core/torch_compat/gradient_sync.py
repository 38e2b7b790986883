# SPDX-License-Identifier: Apache-2.0
"""The ``no_sync`` adapter for torch's engines: DDP's ``model.no_sync()`` and FSDP2's
``set_requires_gradient_sync(False)`` on every FSDP module of the target. :func:`stepforge.core.no_sync` and
the FSDP2 plugins go through :func:`gradient_sync_off`: the one place FSDP2's switch is written."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from .fsdp2 import fsdp2_modules

__all__ = ["fsdp2_no_sync", "gradient_sync_off", "is_ddp", "supports_gradient_sync_off"]


def is_ddp(target: Any) -> bool:
    """Whether ``target`` is a torch ``DistributedDataParallel`` module."""
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(target, DistributedDataParallel)


@contextmanager
def fsdp2_no_sync(target: Any) -> Iterator[None]:
    """``set_requires_gradient_sync(False)`` on every FSDP2 module of ``target`` for the block, ``True`` after.

    ``target`` may be an FSDP2 module or any module that *contains* some (sharding only the blocks is common).
    The flag is read in the backward, so wrapping the backward alone is enough; unsharded gradients are kept
    until the first synchronised backward reduce-scatters them.
    """
    modules: list[Any] = fsdp2_modules(target)  # FSDPModules: set_requires_gradient_sync is not on nn.Module
    for module in modules:
        # recurse=False on each module found: a plain root holding several sharded blocks has no single FSDP
        # module to recurse from, and the flag lives per module.
        module.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for module in modules:
            module.set_requires_gradient_sync(True, recurse=False)


def supports_gradient_sync_off(target: Any) -> bool:
    """Whether :func:`gradient_sync_off` has something to suspend for ``target`` (DDP, or FSDP2 inside)."""
    return is_ddp(target) or bool(fsdp2_modules(target))


def gradient_sync_off(target: Any) -> AbstractContextManager[Any] | None:
    """The torch ``no_sync`` adapter: DDP's ``no_sync()`` (the forward *and* the backward of non-final
    micro-batches must run inside), FSDP2's switch (:func:`fsdp2_no_sync`), else ``None``."""
    if is_ddp(target):
        context: AbstractContextManager[Any] = target.no_sync()
        return context
    if fsdp2_modules(target):
        return fsdp2_no_sync(target)
    return None
