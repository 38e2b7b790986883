# SPDX-License-Identifier: Apache-2.0
"""Every rank ends a save the same way: one outcome, decided where the work ran, raised on every rank.

A save that only rank 0 writes (a model file, a scheduler, a plain optimizer) runs through :func:`on_rank0`: the
other ranks wait for rank 0's outcome (a broadcast) and raise the error rank 0 got, with the same type and text.
A save where every rank did work, or a wait for background writes, ends in :func:`agree`: every rank's failure
(or none) is gathered and every rank raises one :class:`CheckpointError` naming them all. Either way no rank is
left in a later collective until the backend's timeout (gloo's 30 minutes, or whatever the group was given).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from .._env import broadcast_object, get_rank, is_distributed
from ._layout import CheckpointError

__all__ = ["agree", "on_rank0", "describe"]

T = TypeVar("T")

#: errors :func:`on_rank0` hands to the other ranks as they are (a name refused, a bad argument)
_PASSED_ON = (ValueError, TypeError, CheckpointError)


def describe(exc: BaseException) -> str:
    """``Type: message``, as the gathered failures name each rank's error."""
    return f"{type(exc).__name__}: {exc}"


def on_rank0(work: Callable[[], T], *, where: str) -> T:
    """``work()`` on rank 0; every rank returns its result or raises its error (collective when distributed).

    ``ValueError``, ``TypeError`` and :class:`CheckpointError` are raised as they are (the same type and text on
    every rank); anything else becomes a :class:`CheckpointError` naming ``where``, chained to the cause on rank 0.
    """
    outcome: Any = None
    if get_rank() == 0:
        try:
            outcome = ("ok", work())
        except _PASSED_ON as exc:
            outcome = ("raise", exc)
        except Exception as exc:
            wrapped = CheckpointError(f"{where}: {describe(exc)}")
            wrapped.__cause__ = exc
            outcome = ("raise", wrapped)
    if is_distributed():
        mine = outcome
        # the exception object travels pickled (without its traceback); rank 0 keeps its own, chained one
        outcome = broadcast_object(
            outcome if outcome is None or outcome[0] == "ok" else ("raise", _portable(outcome[1]))
        )
        if get_rank() == 0:
            outcome = mine
    kind, value = outcome
    if kind == "raise":
        raise value
    return value  # type: ignore[no-any-return]


def _portable(exc: BaseException) -> BaseException:
    """A copy of ``exc`` that pickles (same type and message, no cause or traceback)."""
    try:
        return type(exc)(*exc.args)
    except Exception:  # an exception type with an unusual constructor
        return CheckpointError(describe(exc))


def agree(local: BaseException | None, *, where: str, what: str, group: Any = None) -> None:
    """Collective when distributed: raise one :class:`CheckpointError` on every rank when any rank's ``local`` is
    an error, naming each failed rank (``"rank 1: OSError: ..."``); return on every rank when none failed.

    Args:
        local: this rank's failure, or None.
        where: the calling function, for the message.
        what: what failed (``"writing 'ckpt/model'"``), for the message.
        group: the process group of every rank (default: the world; a background writer passes its own).
    """
    status = None if local is None else describe(local)
    if is_distributed():
        statuses: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(statuses, status, group=group)
        failures = [f"rank {r}: {s}" for r, s in enumerate(statuses) if s]
    else:
        failures = [status] if status else []
    if failures:
        err = CheckpointError(f"{where}: {what} failed ({'; '.join(failures)})")
        err.__cause__ = local
        raise err
