# SPDX-License-Identifier: Apache-2.0
"""Asynchronous saves (``save_*(use_async=True)``): one background thread per process, one task per save on
every rank, every rank ending each save with the same outcome.

A save call stages the state (copies it away from the live tensors) and checks its target on the calling thread,
then submits one task on every rank, in call order, to the process's one writer thread (``stepforge-ckpt``). Each
task ends with the ranks agreeing (``_writer.agree``): a failure anywhere becomes the same
:class:`CheckpointError` in every rank's future, so waiting (ColossalAI's ``_sync_io``) is local: no collective,
safe in a finaliser.

Every collective of these tasks runs on :func:`async_save_group`, a gloo group of its own: on the default group
they would interleave with the main thread's collectives (the next save's name check, DDP's all-reduce), which
gloo matches by the order they are issued in, and two ranks issuing them in different orders wait for each other
until the backend's timeout. At interpreter exit the writer thread finishes its tasks first (``concurrent.futures``
joins it), then :func:`close_at_exit` reports failures nobody waited for and destroys the writer's group, whose
gloo threads are joined while the interpreter is whole.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from .._env import get_rank, is_distributed
from ._writer import agree, on_rank0

__all__ = ["PendingWrites", "async_save_group", "staged", "write_on_rank0"]

logger = logging.getLogger("stepforge.strategy")


def staged(value: Any) -> Any:
    """A copy of every tensor in ``value`` (dicts/lists/tuples walked), on CPU: what a background write reads."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: staged(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(staged(v) for v in value)
    return value


_GROUP: list[Any] = []  # the group of async_save_group (at most one live)
_POOL: list[ThreadPoolExecutor] = []  # the process's one writer thread
_LOCK = threading.Lock()


def async_save_group() -> Any:
    """The gloo group of every rank that asynchronous saves use for their collectives (None without a process
    group). Created on first use on the calling thread, collectively (every rank saves together), and again
    after the default group was destroyed and set up anew. Gloo also makes it a CPU group, as DCP's
    background saves need under NCCL."""
    if not is_distributed():
        return None
    if _GROUP:
        try:
            dist.get_backend(_GROUP[0])  # raises once the group was destroyed (destroy_process_group())
            return _GROUP[0]
        except (ValueError, RuntimeError):
            _GROUP.clear()
    _GROUP.append(dist.new_group(backend="gloo"))
    return _GROUP[0]


def _run(work: Callable[[], Any] | None, group: Any, where: str) -> Any:
    """A background task: this rank's part of a save, then the ranks agree on the outcome (over ``group``)."""
    local: BaseException | None = None
    result = None
    try:
        if work is not None:
            result = work()
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        local = exc
    agree(local, where=where, what="an asynchronous checkpoint write", group=group)
    return result


class PendingWrites:
    """The asynchronous saves of one checkpoint IO that nobody has waited for yet (see the module docstring)."""

    def __init__(self) -> None:
        self.futures: list[Future[Any]] = []
        _LIVE.add(self)

    def submit(self, work: Callable[[], Any] | None, *, where: str) -> None:
        """Queue this rank's part of one save (None: nothing to write here) on the writer thread. Every rank
        calls it once per save, in the same order; the group is set up here, on the calling thread."""
        group = async_save_group()
        with _LOCK:
            if not _POOL:
                _POOL.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix="stepforge-ckpt"))
        self.futures.append(_POOL[0].submit(_run, work, group, where))

    def wait(self) -> None:
        """Wait for every pending save (no collective: each future already holds the outcome every rank agreed
        on). Raises that :class:`CheckpointError` when a save failed on any rank."""
        futures, self.futures = self.futures, []
        errors = [e for e in (f.exception() for f in futures) if e is not None]
        if errors:
            raise errors[0]

    def close(self) -> None:
        """Wait for the pending saves and log any failure (a finaliser, interpreter exit: never raises)."""
        futures, self.futures = self.futures, []
        for future in futures:
            error = future.exception()
            if error is not None:
                logger.error("checkpoint_io: an asynchronous checkpoint save failed: %s", error)


_LIVE: weakref.WeakSet[PendingWrites] = weakref.WeakSet()


def write_on_rank0(
    work: Callable[[], Any],
    *,
    where: str,
    pending: PendingWrites | None,
    claim: Callable[[], Any] | None = None,
) -> None:
    """``work()`` on rank 0, every rank getting its outcome: now (:func:`on_rank0`), or with ``pending`` on the
    background writer (every rank submits; the ranks agree on the outcome at the wait), after ``claim()`` checked
    the target on rank 0 now, so that a refused name raises at the call on every rank, not at the wait."""
    if pending is None:
        on_rank0(work, where=where)
        return
    if claim is not None:
        on_rank0(claim, where=where)
    pending.submit(work if get_rank() == 0 else None, where=where)


@atexit.register
def close_at_exit() -> None:
    """At interpreter exit, while the interpreter is fully alive: report the failures of saves nobody waited for
    (the writer thread has finished every task by now: ``concurrent.futures`` joins it before ``atexit`` runs),
    then destroy the writer's process group (no collective for gloo), so that its gloo threads are joined now
    rather than during interpreter teardown."""
    for pending in list(_LIVE):
        pending.close()
    if not _GROUP:
        return
    group = _GROUP.pop()
    try:
        dist.get_backend(group)
    except (ValueError, RuntimeError):
        return  # already destroyed with the default group (destroy_process_group())
    dist.destroy_process_group(group)
