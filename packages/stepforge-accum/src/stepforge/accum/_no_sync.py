# SPDX-License-Identifier: Apache-2.0
"""``no_sync`` adapters for torch DDP and FSDP2, registered with :func:`stepforge.core.register_no_sync_adapter`.

- DDP: ``model.no_sync()``. DDP arms its all-reduce in the *forward*, so the forward of every non-final
  micro-batch must run inside the block (the wrappers warn when only the backward does).
- FSDP2 (``fully_shard``): ``set_requires_gradient_sync(False)`` on every FSDP module of the target, restored to
  ``True`` on exit. The flag is read in the backward, so wrapping the backward alone is enough; the price is that
  unsharded gradients are kept until the window's last backward reduce-scatters them. The target may be an FSDP
  module or any module that *contains* FSDP modules (sharding only the blocks, not the root, is common).
- Anything else that satisfies the core protocols (a ZeRO optimizer's ``no_sync()``, a ``GradientSyncSwitch``)
  goes through :func:`stepforge.core.no_sync` unchanged, so sharded optimizers plug in without code here.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from stepforge.core import register_no_sync_adapter

__all__ = ["fsdp2_modules", "install_adapters"]

try:  # torch >= 2.6 exports it here
    from torch.distributed.fsdp import FSDPModule as _FSDPModule
except ImportError:  # pragma: no cover - older torch
    try:
        from torch.distributed._composable.fsdp import FSDPModule as _FSDPModule
    except ImportError:
        _FSDPModule = None


def fsdp2_modules(target: Any) -> list[Any]:
    """Every FSDP2 module in ``target`` (itself included), outermost first."""
    if _FSDPModule is None or not isinstance(target, torch.nn.Module):
        return []
    return [m for m in target.modules() if isinstance(m, _FSDPModule)]


def _is_ddp(target: Any) -> bool:
    return isinstance(target, DistributedDataParallel)


def _ddp_no_sync(target: Any) -> AbstractContextManager[Any]:
    return target.no_sync()


def _is_fsdp2(target: Any) -> bool:
    return not _is_ddp(target) and bool(fsdp2_modules(target))


@contextmanager
def _fsdp2_no_sync(target: Any) -> Iterator[None]:
    modules = fsdp2_modules(target)
    for module in modules:
        # each module found, recurse=False: a plain root holding several sharded blocks has no single
        # FSDP module to recurse from, and the flag lives per module.
        module.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for module in modules:
            module.set_requires_gradient_sync(True, recurse=False)


_INSTALLED = False


def install_adapters() -> None:
    """Register the DDP and FSDP2 adapters once per process (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    register_no_sync_adapter(_is_ddp, _ddp_no_sync)
    register_no_sync_adapter(_is_fsdp2, _fsdp2_no_sync)
    _INSTALLED = True
