# SPDX-License-Identifier: Apache-2.0
"""Buckets and the pointer cache of the fused optimizers (the kernels take raw addresses; this keeps them right).

A param group is split into buckets by ``(device, param dtype, grad dtype, master weights)``; each holds the
pointer arrays the kernels take (``array.array('q')``, read without a copy), the sizes and a flat float32 tensor
of step counts whose elements *are* ``state[p]["step"]`` (0-dim views): one in-place add advances every step.

The cache is revalidated at every step at no per-tensor cost: it holds a weak reference, with a callback, to the
storage behind every address it gives a kernel. Any move that gives a parameter or gradient other memory
(``model.half().float()``, ``.to(device)``, ``p.data = t``, ``p.grad.data = t``) frees the old storage, and its
callback marks the cache stale before that memory can be reused: the next step rebuilds the buckets or refreshes
the grad pointers. Gradient objects are also compared by identity each step. Not seen: a move whose old storage
stays alive elsewhere, and ``untyped_storage().resize_()``; call
:meth:`~stepforge.fused._base.FusedOptimizerBase.invalidate_cache` after those. A per-step ``data_ptr()``
comparison would catch them but cost +26% on the 20 000-tensor benchmark
(``benchmarks/results/fused-cpu/cpu-2026-11-23-cache-check.json``). With ``assume_stable_grads=True`` the
``p.grad`` identity check is skipped too: post-accumulate-grad hooks see new gradients.
"""

from __future__ import annotations

import array
import itertools
import operator
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch

from stepforge.core.torch_compat import dtensor_local, is_dtensor, view_base

from .._validate import check_pair

__all__ = [
    "Bucket",
    "BucketCache",
    "BucketOwner",
    "GroupCache",
    "Launch",
    "Staged",
    "bucket_steps",
    "device_steps",
    "stage",
]


class BucketOwner(Protocol):
    """What building buckets needs from the optimizer (extended by :class:`~.protocol.KernelOwner`)."""

    _owner: str
    #: whether the optimizer keeps a per-parameter ``step`` (False for SGD)
    _uses_steps: bool
    master_weights: bool

    #: the float32 state tensors of ``group``'s params, in kernel argument order
    def _state_keys(self, group: dict[str, Any]) -> tuple[str, ...]: ...

    #: create or normalise ``p``'s state; returns ``(state, created now)``
    def _init_state(
        self, p: torch.Tensor, group: dict[str, Any], moved: bool = False
    ) -> tuple[dict[str, Any], bool]: ...

    #: whether ``device`` takes the sync-free device path (a test may route a device to an emulation)
    def _device_path(self, device: torch.device) -> bool: ...


def _i64(values: Iterable[int]) -> array.array[int]:
    return array.array("q", values)


@dataclass(slots=True, eq=False)
class Bucket:
    """Tensors of one param group sharing ``(device, param dtype, grad dtype, masters)``: pointer arrays by role
    (``"params"``, ``"grads"``, state keys, ``"masters"``), sizes, the flat float32 ``steps`` (``state[p]["step"]``
    is ``steps[i]``; CUDA buckets, ``on_device``, keep them there and the kernels read them through
    ``step_ptrs``), ``steps_arg`` (what the CPU kernel reads: ``steps + 1``) and SGD's ``first_run`` flags."""

    device: torch.device
    param_dtype: torch.dtype
    grad_dtype: torch.dtype
    master: bool
    params: list[torch.Tensor] = field(default_factory=list)
    ptrs: dict[str, array.array[int]] = field(default_factory=dict)
    sizes: array.array[int] = field(default_factory=lambda: _i64(()))
    numel: int = 0
    steps: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    steps_arg: array.array[int] = field(default_factory=lambda: _i64(()))
    first_run: array.array[int] = field(default_factory=lambda: _i64(()))
    on_device: bool = False
    step_ptrs: array.array[int] | None = None
    _steps_arg_t: torch.Tensor | None = None  # views of the arrays above: filled in one tensor op
    _first_run_t: torch.Tensor | None = None

    def prepare_steps(self) -> array.array[int]:
        """Fill ``steps_arg`` with ``state step + 1`` (the step being taken) in two tensor ops."""
        if self._steps_arg_t is not None:
            self._steps_arg_t.copy_(self.steps)
            self._steps_arg_t.add_(1)
        return self.steps_arg

    def clear_first_run(self) -> None:
        if self._first_run_t is not None:
            self._first_run_t.zero_()


@dataclass(slots=True)
class Launch:
    """The per-launch scalars of one kernel call on a bucket: the host ``lr`` (``0.0`` with ``kw["lr_ptr"]``), the
    grad ``divisor``, the skip flag's address (``0``: none), the finite check, ``ctx`` (CPU threads / CUDA stream),
    the host steps being taken (CPU) and the binding's keywords (``device``, ``lr_ptr``, ``step_ptrs``...)."""

    lr: float
    divisor: float
    found_inf_ptr: int = 0
    check_finite: bool = False
    ctx: int = 0
    steps: Any = None
    kw: dict[str, Any] = field(default_factory=dict)


_get_dtype = operator.attrgetter("dtype")
_get_is_sparse = operator.attrgetter("is_sparse")
_get_grad = operator.attrgetter("grad")
_contiguous = torch.Tensor.is_contiguous
_data_ptr = torch.Tensor.data_ptr
_numel = torch.Tensor.numel
_is = operator.is_
_storage = torch.Tensor.untyped_storage


def _local_grads(grads: list[Any]) -> list[Any]:
    return [None if g is None else dtensor_local(g) for g in grads]


class GroupCache:
    """The buckets of one param group and what they were built from: weakref callbacks on the storages the
    buckets point into set ``param_stale``/``stale`` when one is freed (storages are not held, so a moved model
    or freed grads release their memory); a stale cache is rebuilt (params) or refreshed (grads)."""

    __slots__ = (
        "all_set",
        "buckets",
        "dtensor",
        "grad_refs",
        "grads",
        "hooked",
        "members",
        "param_ptrs",
        "param_refs",
        "param_stale",
        "params",
        "stale",
        "watched",
    )

    def __init__(
        self,
        params: list[torch.Tensor],
        views: list[torch.Tensor],
        grads: list[Any],
        buckets: list[Bucket],
        dtensor: bool = False,
        *,
        watch: bool = False,
    ):
        self.params = params  # the group's list (identity: the group was not given another list)
        self.dtensor = dtensor  # DTensor params: ``views``/grads are their local shards
        self.all_set = all(g is not None for g in grads)
        self.buckets = buckets
        self.hooked = False
        self.param_ptrs = _i64(map(_data_ptr, views))
        # a parameter moved to other memory frees its old storage: the callback marks the buckets stale
        stale = self.param_stale = [False]

        def freed(_ref: Any, stale: list[bool] = stale) -> None:
            stale[0] = True

        self.param_refs = [weakref.ref(_storage(v), freed) for v in views]
        self._keep_grads(grads, watch=watch)
        # for each bucket, the positions of its params in the group
        where = {id(p): i for i, p in enumerate(params)}
        self.members = [[where[id(p)] for p in b.params] for b in buckets]

    def _keep_grads(self, grads: list[Any], *, watch: bool) -> None:
        # The callbacks are set up only once the same grads come back a second time (``watch``): with
        # ``zero_grad(set_to_none=True)`` every step brings new grads and the weakrefs would be thrown away
        # unused (they were half of the per-step host time on 20 000 tensors); until then
        # :meth:`grads_unchanged` answers False and the next step re-reads the addresses instead.
        self.grads = grads
        stale = self.stale = [False]
        self.watched = watch
        if not watch:
            self.grad_refs = []
            return

        def freed(_ref: Any, stale: list[bool] = stale) -> None:
            stale[0] = True

        self.grad_refs = [weakref.ref(_storage(g), freed) for g in grads if g is not None]

    def release_grads(self) -> None:
        """Forget the grads (``zero_grad(set_to_none=True)``): the next step re-validates every grad."""
        self.grads = []
        self.grad_refs = []
        self.stale = [True]
        self.watched = False

    def grads_unchanged(self, grads: list[Any]) -> bool:
        """The very grad tensors of the last step, watched since and none of whose storages was freed."""
        return self.watched and not self.stale[0] and self.same_grad_objects(grads)

    def same_grad_objects(self, grads: list[Any]) -> bool:
        """The very grad tensors of the last step (identity only)."""
        return len(grads) == len(self.grads) and all(map(_is, grads, self.grads))

    def refresh_grads(self, grads: list[Any], *, watch: bool = False) -> bool:
        """Point the buckets at new grad tensors (``zero_grad(set_to_none=True)`` + backward re-allocates them
        every step), with C-level loops only. Returns False when the layout must be rebuilt instead (a grad
        appeared or vanished, or changed dtype/size/layout: the full build validates and raises the right
        error). ``watch``: set up the storage callbacks (the same grads were seen again)."""
        all_set = all(map(operator.is_not, grads, itertools.repeat(None)))
        if not (all_set and self.all_set):
            if all_set != self.all_set:
                return False
            old = [g is None for g in self.grads] if self.grads else None
            if old is None or [g is None for g in grads] != old:
                return False  # the set of params with a grad changed (or is unknown after release_grads)
        for bucket, idx in zip(self.buckets, self.members, strict=True):
            if not idx:
                continue
            bg = grads if len(idx) == len(grads) and len(self.buckets) == 1 else [grads[i] for i in idx]
            if not all(map(operator.is_, map(_get_dtype, bg), itertools.repeat(bucket.grad_dtype))):
                return False
            if any(map(_get_is_sparse, bg)) or not all(map(_contiguous, bg)):
                return False
            if _i64(map(_numel, bg)) != bucket.sizes:
                return False  # a grad of another size (``p.grad.data = ...``): the full build raises
            bucket.ptrs["grads"] = _i64(map(_data_ptr, bg))
        self._keep_grads(grads, watch=watch)
        return True


class BucketCache:
    """The buckets of every param group of one optimizer (``entries``: group index -> :class:`GroupCache`), and
    with ``assume_stable_grads`` the post-accumulate-grad ``hooks`` and the grads they vouch for (``known_grads``),
    both by ``id(param)``."""

    __slots__ = ("__weakref__", "assume_stable_grads", "entries", "hooks", "known_grads")

    def __init__(self, assume_stable_grads: bool = False) -> None:
        self.assume_stable_grads = assume_stable_grads
        self.entries: dict[int, GroupCache] = {}
        self.hooks: dict[int, Any] = {}
        self.known_grads: dict[int, Any] = {}

    def invalidate(self) -> None:
        """Forget every group's buckets: the next step rebuilds them."""
        self.entries.clear()

    def release_grads(self) -> None:
        """``zero_grad(set_to_none=True)``: the next backward allocates new grads, so the next step refreshes
        only the grad pointers (far cheaper than a rebuild). Stable-grads entries skip the identity check, so
        they must go through it once (a param left without a grad would otherwise keep a dead pointer)."""
        for entry in self.entries.values():
            entry.hooked = False
            entry.release_grads()

    def group_buckets(self, opt: BucketOwner, index: int, group: dict[str, Any]) -> list[Bucket]:
        """The buckets of ``opt``'s group ``index``, revalidated: parameter addresses always, gradient addresses
        unless the stable-grads hooks vouch for them; a moved parameter rebuilds, moved grads refresh."""
        params = group["params"]
        cached = self.entries.get(index)
        if cached is not None and cached.params is not params:
            cached = None  # another params list: nothing of that entry applies
        dtensor = cached.dtensor if cached is not None else any(map(is_dtensor, params))
        stable = self.assume_stable_grads
        if cached is not None and not cached.param_stale[0]:  # no storage the buckets point into was freed
            if cached.hooked and not cached.stale[0]:
                return cached.buckets
            grads = list(map(_get_grad, params))
            gviews = _local_grads(grads) if dtensor else grads
            # the same grads a second time: watch their storages from now on (reuse loops, DDP/ZeRO buckets)
            watch = stable or cached.same_grad_objects(gviews)
            if cached.grads_unchanged(gviews) or cached.refresh_grads(gviews, watch=watch):
                if stable:
                    cached.hooked = self._hook_params(params)
                return cached.buckets
        else:
            grads = list(map(_get_grad, params))
            gviews = _local_grads(grads) if dtensor else grads
        views = list(map(dtensor_local, params)) if dtensor else params
        moved: frozenset[int] = frozenset()
        if cached is not None and len(params) == len(cached.param_ptrs):
            now = _i64(map(_data_ptr, views))
            moved = frozenset(
                i for i, (a, b) in enumerate(zip(now, cached.param_ptrs, strict=True)) if a != b
            )
        buckets = self.build(opt, group, params, grads, moved)
        entry = GroupCache(params, views, gviews, buckets, dtensor, watch=stable)
        if stable:
            entry.hooked = self._hook_params(params)
        self.entries[index] = entry
        return buckets

    def _hook_params(self, params: list[torch.Tensor]) -> bool:
        """Invalidate the cache when backward hands a parameter a new gradient tensor (stable-grads mode)."""
        if not all(p.requires_grad and p.is_leaf for p in params):
            return False  # no hook possible: keep checking p.grad every step for this group
        ref = weakref.ref(self)
        for p in params:
            if id(p) in self.hooks:
                continue

            def hook(param: torch.Tensor, _ref: Any = ref) -> None:
                cache = _ref()
                # Accumulated in place into the known tensor: nothing to do. A new tensor: rebuild lazily.
                if cache is not None and cache.known_grads.get(id(param)) is not param.grad:
                    cache.entries.clear()

            self.hooks[id(p)] = p.register_post_accumulate_grad_hook(hook)
        self.known_grads.update((id(p), p.grad) for p in params)
        return True

    def build(
        self,
        opt: BucketOwner,
        group: dict[str, Any],
        params: list[torch.Tensor],
        grads: list[Any],
        moved: frozenset[int] = frozenset(),
    ) -> list[Bucket]:
        """The buckets of the pairs :func:`stage` accepts: pointer arrays, sizes and the flat step tensor."""
        keys = opt._state_keys(group)
        buckets = []
        for (device, pdt, gdt, master), entries in stage(opt, group, params, grads, moved).items():
            bucket = Bucket(device, pdt, gdt, master)
            bucket.params = [e.param for e in entries]
            # DTensor params, grads and state: the kernels step the local shards
            bucket.ptrs["params"] = _i64(dtensor_local(e.param).data_ptr() for e in entries)
            bucket.ptrs["grads"] = _i64(dtensor_local(e.grad).data_ptr() for e in entries)
            for name in keys:
                bucket.ptrs[name] = _i64(dtensor_local(e.state[name]).data_ptr() for e in entries)
            if master:
                bucket.ptrs["masters"] = _i64(
                    dtensor_local(e.state["master_param"]).data_ptr() for e in entries
                )
            bucket.sizes = _i64(dtensor_local(e.param).numel() for e in entries)
            bucket.numel = sum(bucket.sizes)
            n = len(entries)
            bucket.on_device = opt._device_path(device)
            if opt._uses_steps:
                steps = bucket.steps = bucket_steps([e.state for e in entries], device)
                if bucket.on_device:
                    bucket.step_ptrs = _i64(range(steps.data_ptr(), steps.data_ptr() + 4 * n, 4))
            else:
                bucket.steps = torch.zeros(n, dtype=torch.float32)
            bucket.steps_arg = _i64([0] * n)
            bucket.first_run = _i64(int(e.fresh) for e in entries)
            if n:
                bucket._steps_arg_t = torch.frombuffer(bucket.steps_arg, dtype=torch.int64)
                bucket._first_run_t = torch.frombuffer(bucket.first_run, dtype=torch.int64)
            buckets.append(bucket)
        return buckets


class Staged(NamedTuple):
    """One (param, grad) pair accepted by :func:`stage`, its state and whether that state was created now."""

    param: torch.Tensor
    grad: torch.Tensor
    state: dict[str, Any]
    fresh: bool


_Staged = dict[tuple[Any, ...], list[Staged]]


def stage(
    opt: BucketOwner,
    group: dict[str, Any],
    params: list[torch.Tensor],
    grads: list[Any],
    moved: frozenset[int] = frozenset(),
) -> _Staged:
    """Validate every (param, grad) pair of ``group`` (params without a grad are left out), create or normalise
    the state (``opt._init_state``) and group the pairs by ``(device, param dtype, grad dtype, masters)``:
    :class:`Staged` each. ``moved``: positions of params given new storage since the
    last build. The eager buckets and the compiled step's lists are both made from this."""
    owner = opt._owner
    if group.get("capturable", False):
        for i, (p, g) in enumerate(zip(params, grads, strict=True)):
            if g is not None and not opt._device_path(p.device):
                raise RuntimeError(
                    f"{owner}: capturable=True needs CUDA parameters (lr and steps on the device for "
                    f"CUDA-graph capture), but parameter #{i} is on {p.device}. Pass capturable=False for "
                    "CPU parameters (torch.optim raises for capturable=True on CPU too)."
                )
    staged: _Staged = {}
    for i, (p, g) in enumerate(zip(params, grads, strict=True)):
        if g is None:
            continue
        check_pair(dtensor_local(p), dtensor_local(g), i, owner=owner)
        state, fresh = opt._init_state(p, group, i in moved)
        master = opt.master_weights and p.dtype != torch.float32
        staged.setdefault((p.device, p.dtype, g.dtype, master), []).append(Staged(p, g, state, fresh))
    return staged


def bucket_steps(states: list[dict[str, Any]], device: torch.device) -> torch.Tensor:
    """One float32 ``(n,)`` tensor on ``device`` holding the states' steps, its elements put back into the states
    as 0-dim views (one in-place add advances every step of the bucket)."""
    flat = device_steps([st["step"] for st in states], device)
    for j, st in enumerate(states):
        st["step"] = flat[j]
    return flat


def device_steps(old: list[Any], device: torch.device) -> torch.Tensor:
    """One flat float32 tensor on ``device`` holding the given steps, without a host round trip when they
    already live there (the common case: a rebuild after ``zero_grad(set_to_none=True)``)."""
    n = len(old)
    base = view_base(old[0]) if n and isinstance(old[0], torch.Tensor) else None
    if (
        base is not None
        and base.device == device
        and base.dtype == torch.float32
        and base.dim() == 1
        and base.numel() == n
        and all(view_base(s) is base and s.storage_offset() == j for j, s in enumerate(old))
    ):
        return base  # the same bucket as before: keep the tensor (and its address, for CUDA graphs)
    if all(isinstance(s, torch.Tensor) and s.device == device for s in old):
        return (
            torch.stack([s.reshape(()).to(torch.float32) for s in old])
            if n
            else torch.zeros(0, device=device)
        )
    # Steps from a CPU checkpoint (torch.optim's non-fused layout): one host-to-device copy, at build only.
    values = [float(s) for s in old]
    if not any(values):
        return torch.zeros(n, dtype=torch.float32, device=device)
    return torch.tensor(values, dtype=torch.float32).to(device)
