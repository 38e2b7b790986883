# SPDX-License-Identifier: Apache-2.0
"""The validated tensor-list layouts of the ``stepforge_fused`` operators' real implementations (a cache).

An operator hands the kernels raw addresses, so :mod:`.checks` must accept its tensor lists first. Those checks and
the kernel's pointer and size arrays depend only on each tensor's address, element count, dtype, device and
contiguity: a call reads these five (one C-level ``map`` pass each, about 45 ns a tensor) and, when they equal
those of a layout accepted before, reuses its verdict and ``array('q')`` pointer arrays; anything else runs the
full checks (which name the offending argument) and caches the new layout. On the demo GPT's 41 tensors this
makes an ``adam_`` call's checks and pointer lists about 35 us instead of 75 us. The cache holds no tensors, so it
never keeps memory alive (a freed layout is served again only to tensors identical in all five properties); it is
bounded (:data:`MAX_LAYOUTS`, :data:`MAX_TENSORS`; the oldest go first). Fake tensors never get here.
"""

from __future__ import annotations

import array
import itertools
import operator
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["MAX_LAYOUTS", "MAX_TENSORS", "Layout", "clear", "layout_of", "size"]

#: most layouts kept (one per bucket and operator of a compiled step is the common case)
MAX_LAYOUTS = 128
#: most tensors over all kept layouts (a layout of more is checked at every call and not kept)
MAX_TENSORS = 1 << 18

_data_ptr = torch.Tensor.data_ptr
_numel = torch.Tensor.numel
_contiguous = torch.Tensor.is_contiguous
_dtype = operator.attrgetter("dtype")
_device = operator.attrgetter("device")
_chain = itertools.chain.from_iterable

_Key = tuple[str, tuple[int, ...], int, int]


def _i64(values: Sequence[int]) -> array.array[int] | None:
    return array.array("q", values) if values else None


class Layout:
    """One accepted call layout: the ``verdict`` of the operator's list checks (e.g. ``(device, param dtype, grad
    dtype)``), one ``array('q')`` of addresses per list (``ptrs``; ``None`` for an empty list: the kernels' "none")
    and the element counts of the first list (``sizes``)."""

    __slots__ = ("counts", "devices", "dtypes", "flat_ptrs", "numels", "ptrs", "sizes", "verdict")

    def __init__(
        self,
        verdict: Any,
        counts: tuple[int, ...],
        flat_ptrs: list[int],
        numels: list[int],
        dtypes: list[torch.dtype],
        devices: list[torch.device],
    ) -> None:
        self.verdict = verdict
        self.counts = counts
        self.flat_ptrs, self.numels, self.dtypes, self.devices = flat_ptrs, numels, dtypes, devices
        bounds = list(itertools.accumulate(counts, initial=0))
        self.ptrs = tuple(_i64(flat_ptrs[a:b]) for a, b in itertools.pairwise(bounds))
        self.sizes = _i64(numels[: counts[0]]) if counts else None


_layouts: dict[_Key, Layout] = {}
_lock = threading.Lock()
_held = [0]  # tensors over all kept layouts


def layout_of(op: str, lists: Sequence[Sequence[torch.Tensor]], check: Callable[[], Any]) -> Layout:
    """The layout of ``lists`` (the operator's tensor lists in kernel order), checked by ``check`` -- the
    operator's list checks, raising on a bad call -- unless an accepted layout matches every tensor's address,
    element count, dtype, device and contiguity."""
    counts = tuple(map(len, lists))
    flat = list(_chain(lists))
    ptrs = list(map(_data_ptr, flat))
    numels = list(map(_numel, flat))
    dtypes = list(map(_dtype, flat))
    devices = list(map(_device, flat))
    key = (op, counts, ptrs[0], ptrs[-1]) if ptrs else None
    cached = _layouts.get(key) if key is not None else None
    if (
        cached is not None
        and cached.flat_ptrs == ptrs
        and cached.numels == numels
        and cached.dtypes == dtypes
        and cached.devices == devices
        and all(map(_contiguous, flat))
    ):
        return cached
    layout = Layout(check(), counts, ptrs, numels, dtypes, devices)
    if key is not None and len(flat) <= MAX_TENSORS:
        _keep(key, layout, len(flat))
    return layout


def _keep(key: _Key, layout: Layout, n: int) -> None:
    with _lock:
        old = _layouts.pop(key, None)
        if old is not None:
            _held[0] -= len(old.flat_ptrs)
        while _layouts and (len(_layouts) >= MAX_LAYOUTS or _held[0] + n > MAX_TENSORS):
            _held[0] -= len(_layouts.pop(next(iter(_layouts))).flat_ptrs)
        _layouts[key] = layout
        _held[0] += n


def clear() -> None:
    """Forget every layout (the next call of each operator runs its full checks)."""
    with _lock:
        _layouts.clear()
        _held[0] = 0


def size() -> tuple[int, int]:
    """``(layouts, tensors)`` kept now."""
    return len(_layouts), _held[0]
