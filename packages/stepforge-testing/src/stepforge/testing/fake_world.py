# SPDX-License-Identifier: Apache-2.0
"""Simulating one rank of a large world in one process: torch's fake process group, fake tensors, and a record of
every collective a plugin calls.

- :func:`run_isolated` runs ``fn(*args)`` in a fresh spawned process (a fake process group, FSDP2's meshes and
  the fake-tensor mode must not leak into the test process) and returns its result.
- :func:`fake_group` initialises the default group as rank ``r`` of ``N`` on torch's ``"fake"`` backend
  (collectives return at once and move nothing) for the block; several worlds can follow in one process.
- :class:`CollectiveRecorder` wraps the ``torch.distributed`` collectives the plugins call (looked up on the
  module at call time, so every call is seen) and records each call's op, payload bytes and group size.
- :func:`fake_parameters` gives a meta-built model fake CPU parameters of a dtype (no memory).

What the fake group cannot show: numerics (nothing is reduced), other ranks' memory, and timings; see
``docs/what-fits.md``.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import tempfile
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from stepforge.core.torch_compat import register_fake_backend

__all__ = [
    "run_isolated",
    "fake_group",
    "CollectiveRecorder",
    "RecordedCall",
    "fake_parameters",
    "COLLECTIVES",
]

#: the collectives recorded, with the argument holding the payload: the full buffer (an all-gather's output, a
#: reduce-scatter's input), as ``stepforge.core.memory_plan.PlannedCollective.nbytes`` counts it
COLLECTIVES: dict[str, tuple[str, int]] = {
    "all_reduce": ("all_reduce", 0),
    "broadcast": ("broadcast", 0),
    "all_gather_into_tensor": ("all_gather", 0),
    "all_gather_single": ("all_gather", 0),
    "reduce_scatter_tensor": ("reduce_scatter", 1),
    "reduce_scatter_single": ("reduce_scatter", 1),
    "all_to_all_single": ("all_to_all", 1),
}


def _child(fn: Callable[..., Any], args: tuple[Any, ...], path: str) -> None:
    torch.set_num_threads(1)
    try:
        result: Any = ("ok", fn(*args))
    except BaseException:  # reported to the parent with the traceback
        result = ("error", traceback.format_exc())
    with open(path, "wb") as f:
        pickle.dump(result, f)


def run_isolated(fn: Callable[..., Any], *args: Any, timeout: float = 300.0) -> Any:
    """``fn(*args)`` in a fresh spawned process; its (picklable) result, or an ``AssertionError`` carrying the
    child's traceback, or a ``TimeoutError`` after ``timeout`` seconds (the child is killed)."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="stepforge-fake-") as tmp:
        path = os.path.join(tmp, "result.pkl")
        proc = ctx.Process(target=_child, args=(fn, args, path))
        proc.start()
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
            raise TimeoutError(f"{getattr(fn, '__qualname__', fn)} did not finish within {timeout:g} s")
        if not os.path.exists(path):
            raise AssertionError(f"{getattr(fn, '__qualname__', fn)} died (exit code {proc.exitcode})")
        with open(path, "rb") as f:
            status, value = pickle.load(f)
    if status != "ok":
        raise AssertionError(f"{getattr(fn, '__qualname__', fn)} failed in its process:\n{value}")
    return value


@contextlib.contextmanager
def fake_group(rank: int, world_size: int) -> Iterator[None]:
    """The default process group as ``rank`` of ``world_size`` on torch's fake backend, for the block."""
    register_fake_backend()
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


@dataclass(frozen=True)
class RecordedCall:
    """One collective call: the op (``"all_gather"``...), the payload bytes and the group's size."""

    op: str
    nbytes: int
    group_size: int


@dataclass
class CollectiveRecorder:
    """Records the collectives called through ``torch.distributed`` inside ``with recorder:``."""

    calls: list[RecordedCall] = field(default_factory=list)

    def __enter__(self) -> CollectiveRecorder:
        self._saved = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
        for name, original in self._saved.items():
            setattr(dist, name, self._wrap(name, original))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._saved.items():
            setattr(dist, name, original)

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        op, position = COLLECTIVES[name]

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            tensors += [v for v in kwargs.values() if isinstance(v, torch.Tensor)]
            payload = tensors[min(position, len(tensors) - 1)]
            group = kwargs.get("group")
            self.calls.append(
                RecordedCall(op, payload.numel() * payload.element_size(), dist.get_world_size(group))
            )
            return original(*args, **kwargs)

        return wrapper

    def totals(self) -> dict[str, tuple[int, int]]:
        """``op -> (calls, payload bytes)`` over the calls recorded with a group of more than one rank."""
        out: dict[str, tuple[int, int]] = {}
        for call in self.calls:
            if call.group_size > 1:
                calls, nbytes = out.get(call.op, (0, 0))
                out[call.op] = (calls + 1, nbytes + call.nbytes)
        return out


def fake_parameters(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """Give ``model`` (built on the meta device) fake CPU parameters and buffers, floating ones in ``dtype``; call
    inside a fake-tensor mode (``stepforge.core.torch_compat.fake_tensor_mode()``). Returns ``model``."""
    for module in model.modules():
        for name, p in [(n, p) for n, p in module._parameters.items() if p is not None]:
            kind = dtype if dtype is not None and p.is_floating_point() else p.dtype
            module._parameters[name] = nn.Parameter(torch.empty(p.shape, dtype=kind), p.requires_grad)
        for name, b in [(n, b) for n, b in module._buffers.items() if b is not None]:
            kind = dtype if dtype is not None and b.is_floating_point() else b.dtype
            module._buffers[name] = torch.empty(b.shape, dtype=kind)
    return model
