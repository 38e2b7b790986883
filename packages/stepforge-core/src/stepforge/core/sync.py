# SPDX-License-Identifier: Apache-2.0
"""``no_sync(*targets)``: one context manager that suspends gradient synchronisation on anything that can.

Gradient accumulation calls it around every micro-batch but the last of a window. Each target may be an
object with a registered adapter, a torch DDP module, a module holding FSDP2 modules (the built-in torch
adapters of :mod:`.torch_compat`), a :class:`~stepforge.core.protocols.NoSyncModel` (ZeRO optimizers), a
:class:`~stepforge.core.protocols.GradientSyncSwitch`, or ``None``/a plain module (nothing to suspend).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any

from .protocols import GradientSyncSwitch, NoSyncModel
from .torch_compat import gradient_sync_off, supports_gradient_sync_off

__all__ = ["no_sync", "register_no_sync_adapter", "supports_no_sync"]

_ADAPTERS: list[tuple[Callable[[Any], bool], Callable[[Any], AbstractContextManager[Any]]]] = []


def register_no_sync_adapter(
    matches: Callable[[Any], bool], adapter: Callable[[Any], AbstractContextManager[Any]]
) -> None:
    """Teach :func:`no_sync` a new kind of target. Adapters registered later take precedence."""
    _ADAPTERS.insert(0, (matches, adapter))


@contextmanager
def _switched_off(target: GradientSyncSwitch) -> Iterator[None]:
    target.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        target.set_requires_gradient_sync(True)


def _context_for(target: Any) -> AbstractContextManager[Any] | None:
    for matches, adapter in _ADAPTERS:
        if matches(target):
            return adapter(target)
    torch_context = gradient_sync_off(target)
    if torch_context is not None:
        return torch_context
    if isinstance(target, NoSyncModel):
        return target.no_sync()
    if isinstance(target, GradientSyncSwitch):
        return _switched_off(target)
    return None


def supports_no_sync(target: Any) -> bool:
    """Whether :func:`no_sync` would suspend anything for ``target``."""
    if target is None:
        return False
    return (
        any(m(target) for m, _ in _ADAPTERS)
        or supports_gradient_sync_off(target)
        or isinstance(target, NoSyncModel | GradientSyncSwitch)
    )


@contextmanager
def no_sync(*targets: Any) -> Iterator[None]:
    """Suspend gradient synchronisation of every target for the block; targets without any are ignored.

    The forward pass must run inside the block too: DDP decides at forward time whether the next backward
    reduces.
    """
    with ExitStack() as stack:
        for target in targets:
            if target is None:
                continue
            ctx = _context_for(target)
            if ctx is not None:
                stack.enter_context(ctx)
        yield
