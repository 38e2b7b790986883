# SPDX-License-Identifier: Apache-2.0
"""The bucket cache of a fused optimizer: one :class:`~._buckets.GroupCache` per param group, built, revalidated
at each step and refreshed (the revalidation rules are in :mod:`._buckets`)."""

from __future__ import annotations

import operator
import weakref
from typing import Any

import torch

from stepforge.core.torch_compat import view_base

from ._buckets import Bucket, GroupCache, _i64, _is_dtensor, _local_grads
from ._protocol import KernelOwner
from ._validate import check_pair, local_tensor

__all__ = ["BucketCache"]

_get_grad = operator.attrgetter("grad")
_data_ptr = torch.Tensor.data_ptr


class BucketCache:
    """The buckets of every param group of one optimizer, and the gradient hooks of ``assume_stable_grads``.

    Attributes:
        assume_stable_grads: trust post-accumulate-grad hooks instead of comparing ``p.grad`` each step.
        entries: group index -> its :class:`GroupCache`.
        hooks: ``id(param)`` -> the post-accumulate-grad hook handle (stable-grads mode).
        known_grads: ``id(param)`` -> the grad tensor the buckets point into (stable-grads mode).
    """

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

    def group_buckets(self, opt: KernelOwner, index: int, group: dict[str, Any]) -> list[Bucket]:
        """The buckets of ``opt``'s group ``index``, revalidated: parameter addresses always, gradient addresses
        unless the stable-grads hooks vouch for them; a moved parameter rebuilds, moved grads refresh."""
        params = group["params"]
        cached = self.entries.get(index)
        if cached is not None and cached.params is not params:
            cached = None  # another params list: nothing of that entry applies
        dtensor = cached.dtensor if cached is not None else any(map(_is_dtensor, params))
        stable = self.assume_stable_grads
        if cached is not None and cached.params_unchanged(params):
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
        views = list(map(local_tensor, params)) if dtensor else params
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
        opt: KernelOwner,
        group: dict[str, Any],
        params: list[torch.Tensor],
        grads: list[Any],
        moved: frozenset[int] = frozenset(),
    ) -> list[Bucket]:
        """Validate every (param, grad) pair, create or normalise the state (``opt._init_state``) and group the
        pairs into buckets by ``(device, param dtype, grad dtype, masters)``; ``moved``: positions of params
        given new storage since the last build."""
        owner = opt._owner
        keys = opt._state_keys(group)
        if group.get("capturable", False):
            for i, (p, g) in enumerate(zip(params, grads, strict=True)):
                if g is not None and not opt._device_path(p.device):
                    raise RuntimeError(
                        f"{owner}: capturable=True needs CUDA parameters (lr and steps on the device for "
                        f"CUDA-graph capture), but parameter #{i} is on {p.device}. Pass capturable=False for "
                        "CPU parameters (torch.optim raises for capturable=True on CPU too)."
                    )
        by_key: dict[tuple[Any, ...], Bucket] = {}
        staged: dict[tuple[Any, ...], list[tuple[torch.Tensor, torch.Tensor, dict[str, Any], bool]]] = {}
        for i, (p, g) in enumerate(zip(params, grads, strict=True)):
            if g is None:
                continue
            check_pair(local_tensor(p), local_tensor(g), i, owner=owner)
            state, fresh = opt._init_state(p, group, i in moved)
            master = opt.master_weights and p.dtype != torch.float32
            key = (p.device, p.dtype, g.dtype, master)
            if key not in by_key:
                by_key[key] = Bucket(p.device, p.dtype, g.dtype, master)
                staged[key] = []
            staged[key].append((p, g, state, fresh))
        buckets = []
        for key, bucket in by_key.items():
            self._fill(opt, bucket, staged[key], keys)
            buckets.append(bucket)
        return buckets

    @staticmethod
    def _fill(
        opt: KernelOwner,
        bucket: Bucket,
        entries: list[tuple[torch.Tensor, torch.Tensor, dict[str, Any], bool]],
        keys: tuple[str, ...],
    ) -> None:
        """Pointer arrays, sizes and the flat step tensor of ``bucket`` from its ``(param, grad, state, fresh)``."""
        bucket.params = [e[0] for e in entries]
        # DTensor params, grads and state: the kernels step the local shards
        bucket.ptrs["params"] = _i64(local_tensor(e[0]).data_ptr() for e in entries)
        bucket.ptrs["grads"] = _i64(local_tensor(e[1]).data_ptr() for e in entries)
        for name in keys:
            bucket.ptrs[name] = _i64(local_tensor(e[2][name]).data_ptr() for e in entries)
        if bucket.master:
            bucket.ptrs["masters"] = _i64(local_tensor(e[2]["master_param"]).data_ptr() for e in entries)
        bucket.sizes = _i64(local_tensor(e[0]).numel() for e in entries)
        bucket.numel = sum(bucket.sizes)
        n = len(entries)
        bucket.on_device = opt._device_path(bucket.device)
        if opt._uses_steps and bucket.on_device:
            steps = device_steps([e[2]["step"] for e in entries], bucket.device)
            for j, e in enumerate(entries):
                e[2]["step"] = steps[j]
            bucket.step_ptrs = _i64(range(steps.data_ptr(), steps.data_ptr() + 4 * n, 4))
        elif opt._uses_steps:
            steps = torch.tensor([float(e[2]["step"]) for e in entries], dtype=torch.float32)
            for j, e in enumerate(entries):
                e[2]["step"] = steps[j]  # 0-dim view: one in-place add advances every step of the bucket
        else:
            steps = torch.zeros(n, dtype=torch.float32)
        bucket.steps = steps
        bucket.steps_arg = _i64([0] * n)
        bucket.first_run = _i64(int(e[3]) for e in entries)
        if n:
            bucket._steps_arg_t = torch.frombuffer(bucket.steps_arg, dtype=torch.int64)
            bucket._first_run_t = torch.frombuffer(bucket.first_run, dtype=torch.int64)


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
