# SPDX-License-Identifier: Apache-2.0
"""``no_sync`` for torch DDP and FSDP2: built into :func:`stepforge.core.no_sync` (its adapters live in
:mod:`stepforge.core.torch_compat`, the one copy of FSDP2's switch shared with the FSDP2 plugins).

- DDP: ``model.no_sync()``. DDP arms its all-reduce in the *forward*, so the forward of every non-final
  micro-batch must run inside the block (the wrappers warn when only the backward does).
- FSDP2 (``fully_shard``): ``set_requires_gradient_sync(False)`` on every FSDP module of the target, restored to
  ``True`` on exit. The target may be an FSDP module or any module that *contains* FSDP modules.
- Anything else that satisfies the core protocols (a ZeRO optimizer's ``no_sync()``, a ``GradientSyncSwitch``)
  goes through :func:`stepforge.core.no_sync` unchanged, so sharded optimizers plug in without code here.
"""

from __future__ import annotations

from typing import Any

from stepforge.core.torch_compat import fsdp2_modules as core_fsdp2_modules

__all__ = ["fsdp2_modules", "install_adapters"]


def fsdp2_modules(target: Any) -> list[Any]:
    """Every FSDP2 module in ``target`` (itself included), outermost first."""
    return core_fsdp2_modules(target)


def install_adapters() -> None:
    """Kept for compatibility: :func:`stepforge.core.no_sync` handles DDP and FSDP2 itself (nothing to register)."""
