# SPDX-License-Identifier: Apache-2.0
"""Run a test function on N gloo processes of this (CPU) machine.

One entry point, :func:`run_distributed`::

    def _check(rank: int, world_size: int, scale: float) -> float:
        t = torch.full((2,), float(rank) * scale)
        dist.all_reduce(t)
        return t.sum().item()

    def test_all_reduce():
        assert run_distributed(_check, 2, 3.0) == [6.0, 6.0]

- ``fn`` runs as ``fn(rank, world_size, *args)`` in a fresh *spawned* process with the default process group
  already initialised (``backend="gloo"``, rendezvous on a free port of 127.0.0.1) and destroyed afterwards.
  ``fn`` and ``args`` are pickled: ``fn`` must be a module-level function of an importable module (a test
  module is fine), not a lambda or a closure.
- The return values come back as a list indexed by rank (they must be picklable; tensors are fine).
- An exception on any rank fails the call with :class:`DistributedTestError`, whose message names the rank and
  carries that rank's traceback; the other ranks are killed instead of being left blocked in a collective.
- ``timeout`` bounds the whole run: a hung collective raises :class:`DistributedTimeoutError` naming the ranks
  that were still running, so CI fails instead of hanging.
- Every process runs with ``OMP_NUM_THREADS=1`` and ``torch.set_num_threads(1)``: N processes on a 2-core
  machine must not each start a full thread pool.

Spawning costs about a second per process (importing torch), so group several checks into one function rather
than spawning per assertion.

Process exit
------------
Distributed runs on gloo used to end now and then with SIGABRT after every check had passed ("terminate called
without an active exception"). That message is libstdc++'s ``std::terminate`` when a joinable ``std::thread``
is destroyed or a C++ thread is unwound out of a ``noexcept`` frame; here the threads are torch's
``ProcessGroupGloo`` workers (and the Python callbacks of DDP communication hooks and async collectives that
they run). When the process group is still alive at interpreter teardown, those threads can still hold Python
objects (the tensors given to a collective, a ``Future.then`` callback) and need the GIL after the interpreter
has started finalising, which ends them abruptly. stepforge.accum starts no thread and leaves no work handle
pending (plain accumulation launches no collective; weighted mode waits for its one all-reduce before the
step); the same DDP + accumulation script written with plain torch has the same exit path
(``tools/repro/ddp_accum_exit.py``, tallies in ``benchmarks/results/accum/logs/sigabrt-50runs-*.txt``: no SIGABRT in 50
runs with stepforge nor in 51 with plain torch, torch 2.13.0; the attribution to torch's teardown rests on that
elimination and on upstream reports, pytorch/pytorch#190489 and #65513, not on a local reproduction). The workaround,
for this launcher and for users' scripts alike: before returning, drop the objects that hold the group (DDP /
FSDP2 models, work handles; ``gc.collect()`` for reference cycles), meet at a barrier and call
``dist.destroy_process_group()``, so ``~ProcessGroupGloo`` joins its threads while the interpreter is alive.
This launcher does exactly that, then still leaves through ``os._exit(0)``, so that a test leaving a C++
thread of its own behind cannot turn a passed run into a crash.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException

__all__ = [
    "run_distributed",
    "DistributedTestError",
    "DistributedTimeoutError",
    "free_port",
    "requires_gloo",
]

#: Skip marker for tests that need ``torch.distributed`` with the gloo backend.
requires_gloo = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the gloo backend is not available in this torch build",
)


class DistributedTestError(AssertionError):
    """A rank raised an exception or exited abnormally. ``rank`` is the first rank that failed."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


class DistributedTimeoutError(DistributedTestError):
    """The run did not finish within ``timeout`` (typically a collective that some rank never entered)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def _environ(updates: Mapping[str, str]) -> Iterator[None]:
    # Children inherit the parent's environment at spawn time, and OMP_NUM_THREADS must be set before a
    # child imports torch, so it is set here and restored afterwards.
    saved = {k: os.environ.get(k) for k in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _worker(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...],
    backend: str,
    timeout_s: float,
    result_dir: str,
) -> None:
    torch.set_num_threads(1)
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group(
        backend=backend,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        result = fn(rank, world_size, *args)
    except BaseException:
        # Record when and where it failed: the ranks blocked in a collective with this one fail a moment
        # later ("connection closed by peer"), and the parent reports the first failure, not theirs.
        # Written aside and renamed: the parent may read it while this rank is being killed.
        path = os.path.join(result_dir, f"rank{rank}.err")
        with open(f"{path}.tmp", "w", encoding="utf-8") as f:
            f.write(f"{time.time_ns()}\n{traceback.format_exc()}")
        os.replace(f"{path}.tmp", path)
        raise
    # A file rather than a queue: a big result in a pipe would block the child before it can exit.
    torch.save(result, os.path.join(result_dir, f"rank{rank}.pt"))
    del result
    _shutdown_process_group()
    # The group is gone and its threads joined, so a normal exit is safe; exiting without interpreter teardown
    # is kept as a second line of defence (see "Process exit" in the module docstring): a test that leaves
    # a C++ thread of its own behind must not abort a run whose checks all passed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _shutdown_process_group() -> None:
    """Destroy the default group while the interpreter is fully alive (the workaround documented above)."""
    # DDP / FSDP2 objects caught in reference cycles still hold the group: collect them first, or
    # destroy_process_group() only unregisters it and ~ProcessGroupGloo runs at interpreter teardown.
    gc.collect()
    # No rank may tear its connections down while a peer still has gloo work in flight (a DDP bucket, an
    # FSDP2 reduce-scatter): the peer's gloo thread then fails ("Connection closed by peer").
    dist.barrier()
    dist.destroy_process_group()
    gc.collect()


def _first_failure(
    result_dir: str, world_size: int, fn: Callable[..., Any], seen_rank: int, seen_detail: str
) -> DistributedTestError:
    """The error of the rank that failed first (by its own clock), the others listed after it."""
    failures: list[tuple[int, int, str]] = []
    for rank in range(world_size):
        path = os.path.join(result_dir, f"rank{rank}.err")
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                stamp, _, text = f.read().partition("\n")
            failures.append((int(stamp), rank, text))
    name = getattr(fn, "__qualname__", repr(fn))
    if not failures:
        return DistributedTestError(
            f"rank {seen_rank} of {world_size} failed in {name}: {seen_detail}", seen_rank
        )
    failures.sort()
    _, rank, text = failures[0]
    others = [r for _, r, _ in failures[1:]]
    tail = f"\n(ranks that failed after it: {others})" if others else ""
    return DistributedTestError(f"rank {rank} of {world_size} raised in {name}:\n{text}{tail}", rank)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    backend: str = "gloo",
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes and return the results by rank.

    Args:
        fn: a module-level (picklable) function; the default process group is initialised when it runs.
        world_size: number of processes (>= 1).
        *args: extra picklable arguments passed to ``fn`` after ``rank`` and ``world_size``.
        timeout: seconds for the whole run, also the process-group timeout; past it the processes are killed
            and :class:`DistributedTimeoutError` is raised.
        backend: ``torch.distributed`` backend (``"gloo"`` on CPU).
        env: extra environment variables for the children.

    Returns:
        ``[fn's return value on rank 0, ..., on rank world_size - 1]``.

    Raises:
        DistributedTestError: a rank raised (the message names it and holds its traceback) or died.
        DistributedTimeoutError: the run exceeded ``timeout``.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"run_distributed: world_size must be an int >= 1, got {world_size!r}")
    if timeout <= 0:
        raise ValueError(f"run_distributed: timeout must be > 0 seconds, got {timeout!r}")
    child_env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(world_size),
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        # without a network, gloo must not try to resolve the host name to an external interface
        "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
        **(dict(env) if env else {}),
    }
    with tempfile.TemporaryDirectory(prefix="stepforge-dist-") as result_dir, _environ(child_env):
        context = mp.start_processes(
            _worker,
            args=(fn, world_size, tuple(args), backend, float(timeout), result_dir),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    alive = [r for r, p in enumerate(context.processes) if p.is_alive()]
                    raise DistributedTimeoutError(
                        f"{getattr(fn, '__qualname__', fn)} on {world_size} {backend} processes did not finish "
                        f"within {timeout:g} s; ranks still running: {alive} (a collective that another rank "
                        "never entered?)"
                    )
                if context.join(timeout=min(remaining, 1.0)):
                    break
        except ProcessRaisedException as exc:
            raise _first_failure(result_dir, world_size, fn, exc.error_index, str(exc)) from None
        except ProcessExitedException as exc:
            detail = f"exited abnormally (exit code {exc.exit_code}, signal {exc.signal_name})"
            raise _first_failure(result_dir, world_size, fn, exc.error_index, detail) from None
        finally:
            for proc in context.processes:
                if proc.is_alive():
                    proc.kill()
            for proc in context.processes:
                proc.join(timeout=5)
        results = []
        for rank in range(world_size):
            path = os.path.join(result_dir, f"rank{rank}.pt")
            results.append(torch.load(path, weights_only=False))
        return results
