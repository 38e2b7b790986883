# SPDX-License-Identifier: Apache-2.0
"""The machinery every fused optimizer shares: bucketing, cached pointer arrays, steps, master weights.

A param group is split into buckets keyed by ``(device, param dtype, grad dtype, master weights)``; each bucket
holds the pointer arrays the kernels take (``array.array('q')``, read without copying by the extension), the
sizes and a flat float32 tensor of per-parameter step counts whose elements *are* ``state[p]["step"]`` (0-dim
views), so one in-place add advances every step of the bucket. Every step revalidates the cache against the tensors (see :class:`_GroupCache`): the ``data_ptr()`` of each
parameter and gradient is compared with the cached address, and the cache holds the storage behind each cached
address, so an unchanged address is the same live memory. Any move that gives a parameter or gradient other
memory (``model.double().float()``, ``.half()``, ``.to(device)``, ``module._apply``, ``p.data = t``,
``p.grad.data = t``) is seen at the next step: parameters rebuild their buckets (state follows the parameter's
device, masters re-sync), gradients refresh their pointers after checking dtype, size and layout.

With ``assume_stable_grads=True`` only the parameter addresses are compared each step; gradients newly allocated
by backward are seen through post-accumulate-grad hooks, ``zero_grad(set_to_none=True)`` makes the next step
check them once, and a gradient assigned or swapped by hand needs :meth:`FusedOptimizerBase.invalidate_cache`
(memory stays safe without it: the old gradient storage is held, never freed under the kernel).
"""

from __future__ import annotations

import array
import itertools
import math
import operator
import weakref
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

import torch

from stepforge.core import HyperParameterError

from . import _backend, _cuda_runtime

__all__ = ["FusedOptimizerBase", "Bucket"]

_is = operator.is_
_NO_KW: dict[str, Any] = {}


def _i64(values: Iterable[int]) -> array.array:
    return array.array("q", values)


class Bucket:
    """Tensors of one param group sharing ``(device, param dtype, grad dtype, masters)``.

    Attributes:
        params: the parameters (leaf tensors), in group order.
        ptrs: pointer arrays by role (``"params"``, ``"grads"``, state keys, ``"masters"``).
        sizes: element counts (int64).
        steps: flat float32 tensor ``(n,)`` on the bucket's device; ``state[p]["step"]`` is ``steps[i]``.
        steps_arg: int64 array the CPU kernel reads (``steps + 1`` at launch).
        on_device: CUDA bucket (sync-free path: device steps, device flags).
        step_ptrs: addresses of the elements of ``steps`` (CUDA buckets; the kernel reads them).
        first_run: int64 flags (SGD: buffer initialised from the grad on this step).
    """

    __slots__ = (
        "_first_run_t",
        "_steps_arg_t",
        "device",
        "first_run",
        "grad_dtype",
        "master",
        "numel",
        "on_device",
        "param_dtype",
        "params",
        "ptrs",
        "sizes",
        "step_ptrs",
        "steps",
        "steps_arg",
    )

    def __init__(self, device: torch.device, param_dtype: torch.dtype, grad_dtype: torch.dtype, master: bool):
        self.device = device
        self.param_dtype = param_dtype
        self.grad_dtype = grad_dtype
        self.master = master
        self.params: list[torch.Tensor] = []
        self.ptrs: dict[str, array.array] = {}
        self.sizes = _i64(())
        self.steps = torch.zeros(0)
        self.steps_arg = _i64(())
        self._steps_arg_t: torch.Tensor | None = None
        self.first_run = _i64(())
        self._first_run_t: torch.Tensor | None = None
        self.numel = 0
        # CUDA buckets: steps live on the device and the kernels read them through step_ptrs (no host copy).
        self.on_device = False
        self.step_ptrs: array.array | None = None

    def prepare_steps(self) -> array.array:
        """Fill ``steps_arg`` with ``state step + 1`` (the step being taken) in two tensor ops."""
        if self._steps_arg_t is not None:
            self._steps_arg_t.copy_(self.steps)
            self._steps_arg_t.add_(1)
        return self.steps_arg

    def clear_first_run(self) -> None:
        if self._first_run_t is not None:
            self._first_run_t.zero_()


_get_dtype = operator.attrgetter("dtype")
_get_is_sparse = operator.attrgetter("is_sparse")
_contiguous = torch.Tensor.is_contiguous
_data_ptr = torch.Tensor.data_ptr
_numel = torch.Tensor.numel


_get_grad = operator.attrgetter("grad")
_storage = torch.Tensor.untyped_storage


def _grad_ptr(g: Any) -> int:
    return 0 if g is None else g.data_ptr()


class _GroupCache:
    """The buckets of one param group and what they were built from.

    Revalidated at every step in two C-level comparisons: the ``data_ptr()`` of every parameter and of every
    gradient against the addresses the buckets hold. The cache keeps a reference to the *storage* behind each
    address it hands to a kernel (``untyped_storage()``), so that storage is never freed while its address is
    cached: an unchanged address is therefore the same live memory, and any move (``model.double().float()``,
    ``.half()``, ``.to(device)``, ``module._apply``, ``p.data = t``, ``p.grad.data = t``, ``resize_``) that gives
    a tensor other memory changes its address and triggers a rebuild (params) or a refresh (grads), which
    re-validates dtype, shape, device and layout. ``zero_grad(set_to_none=True)`` drops the grad storages.
    """

    __slots__ = (
        "all_set",
        "buckets",
        "grad_ptrs",
        "grad_storages",
        "hooked",
        "members",
        "param_ptrs",
        "param_storages",
        "params",
    )

    def __init__(self, params: list[torch.Tensor], grads: list[Any], buckets: list[Bucket]):
        self.params = params
        self.all_set = all(g is not None for g in grads)
        self.buckets = buckets
        self.hooked = False
        self.param_ptrs = _i64(map(_data_ptr, params))
        self.param_storages = list(map(_storage, params))
        self._keep_grads(grads)
        # for each bucket, the positions of its params in the group
        where = {id(p): i for i, p in enumerate(params)}
        self.members = [[where[id(p)] for p in b.params] for b in buckets]

    def _keep_grads(self, grads: list[Any]) -> None:
        if self.all_set:
            self.grad_ptrs = _i64(map(_data_ptr, grads))
            self.grad_storages = list(map(_storage, grads))
        else:
            self.grad_ptrs = _i64(map(_grad_ptr, grads))
            self.grad_storages = [None if g is None else g.untyped_storage() for g in grads]

    def release_grads(self) -> None:
        """Forget the grad storages (``zero_grad(set_to_none=True)``): the next step re-validates every grad."""
        self.grad_storages = []
        self.grad_ptrs = _i64(())

    def params_unchanged(self, params: list[torch.Tensor]) -> bool:
        """Every parameter still at the address (so in the live storage) the buckets were built with."""
        return self.params is params and _i64(map(_data_ptr, params)) == self.param_ptrs

    def grads_unchanged(self, grads: list[Any]) -> bool:
        """Every gradient still at the cached address, and none appeared or vanished."""
        if self.all_set:
            try:
                return _i64(map(_data_ptr, grads)) == self.grad_ptrs
            except TypeError:  # a grad became None
                return False
        return _i64(map(_grad_ptr, grads)) == self.grad_ptrs

    def refresh_grads(self, grads: list[Any]) -> bool:
        """Point the buckets at new grad tensors (``zero_grad(set_to_none=True)`` + backward re-allocates them
        every step), with C-level loops only. Returns False when the layout must be rebuilt instead (a grad
        appeared or vanished, or changed dtype/size/layout: the full build validates and raises the right
        error)."""
        all_set = all(map(operator.is_not, grads, itertools.repeat(None)))
        if not (all_set and self.all_set):
            if all_set != self.all_set:
                return False
            old = [p is None for p in self.grad_storages] if self.grad_storages else None
            if old is None or [g is None for g in grads] != old:
                return False  # the set of params with a grad changed (or is unknown after release_grads)
        for bucket, idx in zip(self.buckets, self.members, strict=True):
            if not idx:
                continue
            bg = [grads[i] for i in idx]
            if not all(map(operator.is_, map(_get_dtype, bg), itertools.repeat(bucket.grad_dtype))):
                return False
            if any(map(_get_is_sparse, bg)) or not all(map(_contiguous, bg)):
                return False
            if _i64(map(_numel, bg)) != bucket.sizes:
                return False  # a grad of another size (``p.grad.data = ...``): the full build raises
            bucket.ptrs["grads"] = _i64(map(_data_ptr, bg))
        self._keep_grads(grads)
        return True


class FusedOptimizerBase(torch.optim.Optimizer):
    """Base class of the stepforge fused optimizers (not public API).

    Subclasses define ``_owner`` (class name for messages), ``_state_keys(group)`` (float32 state tensors
    shaped like the param), ``_launch(module, bucket, group, lr, divisor, found_inf_ptr, check_finite, ctx,
    steps, kw)``, and may override ``_pre_step(buckets_by_group, divisor)`` (LAMB's global norm, host path) and
    ``_device_clip_norm()`` (the same clip on the CUDA path).
    """

    _owner = "FusedOptimizer"
    # False for SGD: torch.optim.SGD keeps no per-parameter step.
    _uses_steps = True
    # GradScaler calls step() without unscaling and sets `grad_scale` / `found_inf` on the optimizer instead.
    _step_supports_amp_scaling = True

    def __init__(
        self,
        params: Any,
        defaults: dict[str, Any],
        *,
        master_weights: bool = False,
        skip_nonfinite: bool | None = None,
        assume_stable_grads: bool = False,
        capturable: bool = False,
    ):
        if not isinstance(capturable, bool):
            raise HyperParameterError(f"{self._owner}: capturable must be a bool, got {capturable!r}")
        if capturable:
            # A group option, as in torch.optim (recorded in state_dict(); checked per group at step time).
            defaults = {**defaults, "capturable": True}
        if not isinstance(master_weights, bool):
            raise HyperParameterError(f"{self._owner}: master_weights must be a bool, got {master_weights!r}")
        if skip_nonfinite is not None and not isinstance(skip_nonfinite, bool):
            raise HyperParameterError(
                f"{self._owner}: skip_nonfinite must be a bool or None, got {skip_nonfinite!r}"
            )
        if not isinstance(assume_stable_grads, bool):
            raise HyperParameterError(
                f"{self._owner}: assume_stable_grads must be a bool, got {assume_stable_grads!r}"
            )
        self.master_weights = master_weights
        self.skip_nonfinite = skip_nonfinite
        self.assume_stable_grads = assume_stable_grads
        self._hooked: dict[int, Any] = {}
        self._known_grads: dict[int, Any] = {}
        self._host_last_skipped = False
        self._host_skipped = 0
        self._last_flags: list[torch.Tensor] = []
        self._flags: dict[torch.device, torch.Tensor] = {}
        self._skip_counts: dict[torch.device, torch.Tensor] = {}
        self._lr_bufs: dict[tuple[int, torch.device], tuple[float, torch.Tensor]] = {}
        self._cache: dict[int, _GroupCache] = {}
        super().__init__(params, defaults)

    # ---- skip reporting ------------------------------------------------------------------------------------
    # On CUDA the skip decision stays on the device (no sync inside step()); these properties read it back
    # only when asked, so reading them after a CUDA step synchronises with the stream.
    @property
    def last_step_skipped(self) -> bool:
        """Whether the last ``step()`` was skipped (inf/NaN grads, or GradScaler's ``found_inf``)."""
        if self._host_last_skipped:
            return True
        return any(bool(f.ne(0).any()) for f in self._last_flags)

    @last_step_skipped.setter
    def last_step_skipped(self, value: bool) -> None:
        self._host_last_skipped = bool(value)
        self._last_flags = []

    @property
    def skipped_steps(self) -> int:
        """How many ``step()`` calls were skipped so far (device counters included, read on access)."""
        return self._host_skipped + sum(int(c.sum().item()) for c in self._skip_counts.values())

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._host_skipped = int(value)
        self._skip_counts = {}

    def _skip_on_host(self) -> None:
        self._host_last_skipped = True
        self._host_skipped += 1

    # ---- torch.optim plumbing --------------------------------------------------------------------------
    _PICKLED_OPTIONS = ("master_weights", "skip_nonfinite", "assume_stable_grads", "set_grad_none")

    def __getstate__(self) -> dict[str, Any]:
        # torch.optim pickles defaults/state/param_groups only; keep our options, never the pointer caches.
        state = super().__getstate__()
        state.update({k: self.__dict__[k] for k in self._PICKLED_OPTIONS if k in self.__dict__})
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("_cache", {})
        self.__dict__.setdefault("master_weights", False)
        self.__dict__.setdefault("skip_nonfinite", None)
        self.__dict__.setdefault("_host_last_skipped", bool(self.__dict__.pop("last_step_skipped", False)))
        self.__dict__.setdefault("_host_skipped", int(self.__dict__.pop("skipped_steps", 0)))
        for key in ("_flags", "_skip_counts", "_lr_bufs"):
            self.__dict__.setdefault(key, {})
        self.__dict__.setdefault("_last_flags", [])
        self.__dict__.setdefault("assume_stable_grads", False)
        self.__dict__.setdefault("_hooked", {})
        self.__dict__.setdefault("_known_grads", {})

    def invalidate_cache(self) -> None:
        """Forget the cached pointer arrays (needed only after swapping storage under a param or grad)."""
        self._cache.clear()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        if hasattr(self, "_cache"):
            self._cache.clear()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of this class or of ``torch.optim.AdamW``/``Adam``/``SGD`` (same state layout).

        Group options missing from ``state_dict`` (e.g. ``bias_correction`` in a torch checkpoint) keep this
        optimizer's current values, so a torch checkpoint never raises ``KeyError`` (apex #577); ``capturable``
        always keeps this optimizer's value. Steps saved on the CPU (torch's non-fused layout) move to a CUDA
        parameter's device at the next step (one copy), steps saved on a device are used in place.
        """
        own = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        # torch.optim casts every floating state tensor to its param's dtype on load, which would round float32
        # moments and masters of fp16/bf16 params: keep the float32 values aside and put them back after.
        saved_ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
        own_params = [p for g in self.param_groups for p in g["params"]]
        wide: dict[int, dict[str, torch.Tensor]] = {}
        for pid, p in zip(saved_ids, own_params, strict=False):
            st = state_dict["state"].get(pid, {})
            keep = {
                k: v
                for k, v in st.items()
                if k != "step"
                and isinstance(v, torch.Tensor)
                and v.is_floating_point()
                and v.dtype != p.dtype
            }
            if keep:
                wide[id(p)] = keep
        super().load_state_dict(state_dict)
        for p in own_params:
            for key, value in wide.get(id(p), {}).items():
                self.state[p][key] = value.to(device=p.device, dtype=torch.float32, copy=True)
        for old, group in zip(own, self.param_groups, strict=True):
            for key, value in old.items():
                group.setdefault(key, value)
            if "capturable" in old or "capturable" in group:
                # How this instance runs (device lr for CUDA graphs, CPU params allowed or not), not a property
                # of the checkpoint: keep the constructor's choice, whatever optimizer wrote the state.
                group["capturable"] = bool(old.get("capturable", False))
            self._check_loaded_group(group)
        self._cache.clear()

    def _check_loaded_group(self, group: dict[str, Any]) -> None:
        if group.get("amsgrad", False):
            raise HyperParameterError(
                f"{self._owner}: the loaded state uses amsgrad=True, which is not supported."
            )
        if group.get("maximize", False):
            raise HyperParameterError(
                f"{self._owner}: the loaded state uses maximize=True, which is not supported."
            )

    def _torch_group_keys(self, group: dict[str, Any]) -> dict[str, Any]:
        """Extra keys written into state_dict() groups so torch.optim loads them with the same semantics."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        for saved, group in zip(sd["param_groups"], self.param_groups, strict=True):
            for key, value in self._torch_group_keys(group).items():
                saved.setdefault(key, value)
        return sd

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        if set_to_none:
            # The next backward allocates new grads: the per-step identity check then refreshes only the grad
            # pointers, which is far cheaper than rebuilding the buckets. Stable-grads entries skip that check,
            # so they must go through it once (a param left without a grad would otherwise keep a dead pointer).
            for entry in self._cache.values():
                entry.hooked = False
                entry.release_grads()

    # ---- hooks for subclasses --------------------------------------------------------------------------
    def _state_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        raise NotImplementedError

    def _launch(
        self,
        module: ModuleType,
        bucket: Bucket,
        group: dict[str, Any],
        lr: float,
        divisor: float,
        found_inf_ptr: int,
        check_finite: bool,
        ctx: int,
        steps: Any,
        kw: dict[str, Any],
    ) -> bool | None:
        """Call the kernel of this optimizer on ``bucket``.

        ``steps``: the host int64 step array (CPU) or ``None`` (CUDA: ``kw["step_ptrs"]``); ``kw``: the CUDA
        keyword-only arguments (``device``, ``lr_ptr``, ``grad_divisor_ptr``, ``step_ptrs``), empty for CPU.
        """
        raise NotImplementedError

    def _pre_step(self, plans: list[tuple[dict[str, Any], list[Bucket]]], divisor: float) -> float:
        """Adjust the grad divisor before any update (LAMB: global grad-norm clip). Returns the divisor."""
        return divisor

    # ---- bucket building ---------------------------------------------------------------------------------
    def _group_buckets(self, index: int, group: dict[str, Any]) -> list[Bucket]:
        """The group's buckets, revalidated: parameter addresses always, gradient addresses unless the
        stable-grads hooks vouch for them; a moved parameter rebuilds, moved grads refresh."""
        params = group["params"]
        cached = self._cache.get(index)
        if cached is not None and cached.params_unchanged(params):
            if cached.hooked:
                return cached.buckets
            grads = list(map(_get_grad, params))
            if cached.grads_unchanged(grads) or cached.refresh_grads(grads):
                if self.assume_stable_grads:
                    cached.hooked = self._hook_params(params)
                return cached.buckets
        else:
            grads = list(map(_get_grad, params))
        moved: frozenset[int] = frozenset()
        if cached is not None and cached.params is params and len(params) == len(cached.param_ptrs):
            now = _i64(map(_data_ptr, params))
            moved = frozenset(i for i, (a, b) in enumerate(zip(now, cached.param_ptrs, strict=True)) if a != b)
        buckets = self._build_buckets(group, params, grads, moved)
        entry = _GroupCache(params, grads, buckets)
        if self.assume_stable_grads:
            entry.hooked = self._hook_params(params)
        self._cache[index] = entry
        return buckets

    def _hook_params(self, params: list[torch.Tensor]) -> bool:
        """Invalidate the cache when backward hands a parameter a new gradient tensor (stable-grads mode)."""
        if not all(p.requires_grad and p.is_leaf for p in params):
            return False  # no hook possible: keep checking p.grad every step for this group
        ref = weakref.ref(self)
        for p in params:
            if id(p) in self._hooked:
                continue

            def hook(param: torch.Tensor, _ref: Any = ref) -> None:
                opt = _ref()
                # Accumulated in place into the known tensor: nothing to do. A new tensor: rebuild lazily.
                if opt is not None and opt._known_grads.get(id(param)) is not param.grad:
                    opt._cache.clear()

            self._hooked[id(p)] = p.register_post_accumulate_grad_hook(hook)
        self._known_grads.update((id(p), p.grad) for p in params)
        return True

    def _validate_pair(self, p: torch.Tensor, g: torch.Tensor, index: int) -> None:
        owner = self._owner
        where = f"parameter #{index} (shape {tuple(p.shape)}, {p.dtype}, {p.device})"
        if g.is_sparse or p.is_sparse:
            raise RuntimeError(
                f"{owner}: {where} has a sparse gradient; the fused kernels need dense gradients."
            )
        if g.device != p.device:
            raise RuntimeError(
                f"{owner}: {where} has its gradient on {g.device}; a parameter and its gradient must share a "
                "device (move the gradient, or the parameter)."
            )
        if g.shape != p.shape:
            raise RuntimeError(
                f"{owner}: {where} has a gradient of shape {tuple(g.shape)}; shapes must match."
            )
        if not p.is_contiguous():
            raise RuntimeError(
                f"{owner}: {where} is not contiguous; the kernels update memory in place and a copy would be "
                "silently lost. Make the parameter contiguous before creating the optimizer."
            )
        if not g.is_contiguous():
            raise RuntimeError(
                f"{owner}: the gradient of {where} is not contiguous (strides {g.stride()}); pass contiguous "
                "gradients (e.g. p.grad = p.grad.contiguous())."
            )
        if p.device.type not in ("cpu", "cuda"):
            raise RuntimeError(f"{owner}: {where} is on {p.device}; only CPU and CUDA tensors are supported.")
        _backend.dtype_code(p.dtype, what=where, owner=owner)
        _backend.dtype_code(g.dtype, what=f"the gradient of {where}", owner=owner)

    def _init_state(
        self, p: torch.Tensor, group: dict[str, Any], moved: bool = False
    ) -> tuple[dict[str, Any], bool]:
        """Create (or normalise a loaded or moved) state for ``p``; returns (state, created_momentum_now).

        State follows its parameter: tensors move to the parameter's device and stay float32 (``moved``: the
        parameter got new storage since the last build, so a master copy is re-synced from it if they differ).
        """
        state = self.state[p]
        fresh = False
        if self._uses_steps and "step" not in state:
            # torch.optim layout: a 0-dim float32 tensor, on the param's device for CUDA params (as torch's
            # fused/capturable AdamW), so device steps need no host copy.
            state["step"] = torch.zeros(
                (), dtype=torch.float32, device=p.device if self._device_path(p.device) else None
            )
        for key in self._state_keys(group):
            buf = state.get(key)
            if buf is None:
                state[key] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
                fresh = True
            elif buf.dtype != torch.float32 or buf.device != p.device or not buf.is_contiguous():
                # A torch checkpoint of fp16/bf16 params keeps low-precision moments: widen them (exact).
                state[key] = buf.to(device=p.device, dtype=torch.float32).contiguous()
            if state[key].shape != p.shape and moved:
                raise RuntimeError(
                    f"{self._owner}: a parameter was given new storage of shape {tuple(p.shape)} but its "
                    f"state['{key}'] has shape {tuple(state[key].shape)}; state cannot follow a change of size. "
                    "Start it afresh with `del optimizer.state[param]` (or rebuild the optimizer)."
                )
            if state[key].shape != p.shape:
                raise RuntimeError(
                    f"{self._owner}: state['{key}'] has shape {tuple(state[key].shape)} but its parameter has "
                    f"shape {tuple(p.shape)}; the loaded state does not belong to these parameters."
                )
        if self.master_weights and p.dtype != torch.float32:
            w = state.get("master_param")
            if w is None or w.shape != p.shape:
                state["master_param"] = p.detach().to(torch.float32).contiguous()
            else:
                if w.dtype != torch.float32 or w.device != p.device or not w.is_contiguous():
                    w = state["master_param"] = w.to(device=p.device, dtype=torch.float32).contiguous()
                if moved and not torch.equal(w.to(p.dtype), p.detach()):
                    # new values were put into the parameter (p.data = t, a load): they win over the master
                    w.copy_(p.detach())
        elif "master_param" in state:
            # the parameter became float32 (model.float()): it is its own master now, as in torch.optim
            del state["master_param"]
        return state, fresh

    def _build_buckets(
        self,
        group: dict[str, Any],
        params: list[torch.Tensor],
        grads: list[Any],
        moved: frozenset[int] = frozenset(),
    ) -> list[Bucket]:
        keys = self._state_keys(group)
        if group.get("capturable", False):
            for i, (p, g) in enumerate(zip(params, grads, strict=True)):
                if g is not None and not self._device_path(p.device):
                    raise RuntimeError(
                        f"{self._owner}: capturable=True needs CUDA parameters (lr and steps on the device for "
                        f"CUDA-graph capture), but parameter #{i} is on {p.device}. Pass capturable=False for "
                        "CPU parameters (torch.optim raises for capturable=True on CPU too)."
                    )
        by_key: dict[tuple[Any, ...], Bucket] = {}
        staged: dict[tuple[Any, ...], list[tuple[torch.Tensor, torch.Tensor, dict[str, Any], bool]]] = {}
        for i, (p, g) in enumerate(zip(params, grads, strict=True)):
            if g is None:
                continue
            self._validate_pair(p, g, i)
            state, fresh = self._init_state(p, group, i in moved)
            master = self.master_weights and p.dtype != torch.float32
            key = (p.device, p.dtype, g.dtype, master)
            if key not in by_key:
                by_key[key] = Bucket(p.device, p.dtype, g.dtype, master)
                staged[key] = []
            staged[key].append((p, g, state, fresh))
        buckets = []
        for key, bucket in by_key.items():
            entries = staged[key]
            bucket.params = [e[0] for e in entries]
            bucket.ptrs["params"] = _i64(e[0].data_ptr() for e in entries)
            bucket.ptrs["grads"] = _i64(e[1].data_ptr() for e in entries)
            for name in keys:
                bucket.ptrs[name] = _i64(e[2][name].data_ptr() for e in entries)
            if bucket.master:
                bucket.ptrs["masters"] = _i64(e[2]["master_param"].data_ptr() for e in entries)
            bucket.sizes = _i64(e[0].numel() for e in entries)
            bucket.numel = sum(bucket.sizes)
            n = len(entries)
            bucket.on_device = self._device_path(bucket.device)
            if self._uses_steps and bucket.on_device:
                steps = self._device_steps([e[2]["step"] for e in entries], bucket.device)
                for j, e in enumerate(entries):
                    e[2]["step"] = steps[j]
                bucket.step_ptrs = _i64(range(steps.data_ptr(), steps.data_ptr() + 4 * n, 4))
            elif self._uses_steps:
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
            buckets.append(bucket)
        return buckets

    @staticmethod
    def _device_steps(old: list[Any], device: torch.device) -> torch.Tensor:
        """One flat float32 tensor on ``device`` holding the given steps, without a host round trip when they
        already live there (the common case: a rebuild after ``zero_grad(set_to_none=True)``)."""
        n = len(old)
        base = old[0]._base if n and isinstance(old[0], torch.Tensor) else None
        if (
            base is not None
            and base.device == device
            and base.dtype == torch.float32
            and base.dim() == 1
            and base.numel() == n
            and all(s._base is base and s.storage_offset() == j for j, s in enumerate(old))
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

    @staticmethod
    def _device_path(device: torch.device) -> bool:
        """Whether tensors on ``device`` take the sync-free device path (CUDA)."""
        return device.type == "cuda"

    @staticmethod
    def _device_env(device: torch.device) -> tuple[int, int]:
        """``(ctx, device index)`` of a CUDA launch: the caller's current stream on that device."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        return int(torch.cuda.current_stream(index).cuda_stream), index

    def _device_clip_norm(self) -> float:
        """Global grad-norm clip threshold applied on the device path (LAMB); ``0`` = none."""
        return 0.0

    # ---- step ----------------------------------------------------------------------------------------------

    @staticmethod
    def _device_kw(device: torch.device) -> dict[str, Any]:
        """Extra keyword for the CUDA module: the device index (the CPU module takes none)."""
        if device.type == "cuda":
            return {"device": device.index if device.index is not None else torch.cuda.current_device()}
        return {}

    @staticmethod
    def _ctx(module: ModuleType, device: torch.device) -> int:
        if device.type == "cpu":
            return _backend.get_num_threads()
        return int(torch.cuda.current_stream(device).cuda_stream)

    @torch.no_grad()
    def _fused_step(self, closure: Callable[[], Any] | None, div_scale: float = -1) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        divisor = 1.0
        if div_scale is not None and div_scale > 0:
            divisor = float(div_scale)
        # Set by torch.amp.GradScaler (_step_supports_amp_scaling): CUDA tensors stay on the device.
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        self._host_last_skipped = False
        self._last_flags = []
        if found_inf is not None and not (
            isinstance(found_inf, torch.Tensor) and self._device_path(found_inf.device)
        ):
            if float(found_inf) != 0.0:
                self._skip_on_host()
                return loss
            found_inf = None
        if grad_scale is not None and not (
            isinstance(grad_scale, torch.Tensor) and self._device_path(grad_scale.device)
        ):
            divisor *= float(grad_scale)
            grad_scale = None
        plans = [(group, self._group_buckets(i, group)) for i, group in enumerate(self.param_groups)]
        buckets = [(group, b) for group, bs in plans for b in bs if b.numel > 0 or b.params]
        if not buckets:
            return loss
        check = self.skip_nonfinite if self.skip_nonfinite is not None else self.master_weights
        if not math.isfinite(divisor) or divisor <= 0:
            raise HyperParameterError(
                f"{self._owner}: the gradient divisor must be positive and finite, got {divisor}"
            )
        if all(b.on_device for _group, b in buckets):
            self._device_step(buckets, divisor, grad_scale, found_inf, check)
            return loss
        # Host path (CPU buckets, possibly beside CUDA ones in HybridAdam): skip decisions are made on the host.
        if found_inf is not None and float(found_inf) != 0.0:
            self._skip_on_host()
            return loss
        if grad_scale is not None:
            divisor *= float(grad_scale)
        # The whole step is skipped on a non-finite grad: with several buckets, check all of them first.
        pre_checked = False
        if check and len(buckets) > 1:
            for _group, b in buckets:
                module = _backend.module_for(b.device)
                norm = module.l2norm(
                    b.ptrs["grads"],
                    b.sizes,
                    _backend.DTYPE_CODES[b.grad_dtype],
                    0,
                    self._ctx(module, b.device),
                    **self._device_kw(b.device),
                )
                if not math.isfinite(norm / divisor):
                    self._skip_on_host()
                    return loss
            pre_checked = True
        divisor = self._pre_step(plans, divisor)
        uses_steps = self._uses_steps
        for group, b in buckets:
            module = _backend.module_for(b.device)
            ctx = self._ctx(module, b.device)
            if b.on_device:
                if uses_steps:
                    b.steps.add_(1)  # the device kernels read the step being taken
                lr, kw = self._device_lr(group, b.device, self._device_kw(b.device))
                if uses_steps:
                    kw["step_ptrs"] = b.step_ptrs
                skipped = self._launch(
                    module, b, group, lr, divisor, 0, check and not pre_checked, ctx, None, kw
                )
                if skipped and uses_steps:
                    b.steps.sub_(1)
            else:
                skipped = self._launch(
                    module,
                    b,
                    group,
                    float(group["lr"]),
                    divisor,
                    0,
                    check and not pre_checked,
                    ctx,
                    b.prepare_steps(),
                    _NO_KW,
                )
                if not skipped and uses_steps:
                    b.steps.add_(1)
            if skipped:
                # Only possible on the first (single) bucket: nothing has been written yet.
                self._skip_on_host()
                return loss
            b.clear_first_run()
        return loss

    def _device_lr(
        self, group: dict[str, Any], device: torch.device, kw: dict[str, Any]
    ) -> tuple[float, dict[str, Any]]:
        """The host ``lr`` of a CUDA launch, or ``0.0`` with ``kw["lr_ptr"]`` set when lr lives on the device.

        A 0-dim/1-element float32 CUDA ``lr`` tensor is read by the kernel in place (so a captured graph sees
        later ``lr.fill_(...)``); with ``capturable=True`` a float lr is kept in a device buffer, refreshed
        (on the stream, no sync) when the group's value changes.
        """
        lr = group["lr"]
        if isinstance(lr, torch.Tensor):
            if lr.device.type == "cpu" and not group.get("capturable", False):
                return float(lr), kw  # host value: no device synchronisation
            if lr.numel() != 1:
                raise HyperParameterError(
                    f"{self._owner}: a Tensor lr must have one element, got {lr.numel()}"
                )
            if lr.device != device or lr.dtype != torch.float32 or not lr.is_contiguous():
                if group.get("capturable", False) and lr.device.type == "cpu":
                    raise RuntimeError(
                        f"{self._owner}: with capturable=True a Tensor lr must live on the parameters' device "
                        f"({device}), got one on {lr.device}; pass lr=torch.tensor(value, device='{device}')."
                    )
                # Freed after the launch is enqueued: safe, the caching allocator reuses it in stream order.
                lr = lr.to(device=device, dtype=torch.float32, non_blocking=True).contiguous()
            kw["lr_ptr"] = lr.data_ptr()
            return 0.0, kw
        if not group.get("capturable", False):
            return float(lr), kw
        key = (id(group), device)
        value = float(lr)
        cached = self._lr_bufs.get(key)
        if cached is None or cached[0] != value:
            buf = cached[1] if cached is not None else torch.empty(1, dtype=torch.float32, device=device)
            buf.fill_(value)
            self._lr_bufs[key] = (value, buf)
            cached = self._lr_bufs[key]
        kw["lr_ptr"] = cached[1].data_ptr()
        return 0.0, kw

    def _device_step(
        self,
        buckets: list[tuple[dict[str, Any], Bucket]],
        divisor: float,
        grad_scale: torch.Tensor | None,
        found_inf: torch.Tensor | None,
        check: bool,
    ) -> None:
        """The CUDA step with no host synchronisation: every skip decision and clip factor stays on the device.

        Per device: ``flag`` (a persistent float32 element, ``found_inf_ptr`` of every launch) starts as
        GradScaler's ``found_inf`` (or 0); with several buckets or LAMB's clip, ``l2norm`` sums ``g^2`` into a
        device float first, which gives the clip factor and raises ``flag`` on inf/NaN, so each launch skips on
        the device; with one bucket the kernel's own finite check sets ``flag``. Steps are advanced by
        ``1 - flag`` before the launch (or by 1 and rolled back by ``flag`` after the kernel's check).
        """
        by_dev: dict[torch.device, list[tuple[dict[str, Any], Bucket]]] = {}
        for item in buckets:
            by_dev.setdefault(item[1].device, []).append(item)
        clip_norm = self._device_clip_norm()
        need_norm = clip_norm > 0 or (check and len(buckets) > 1)
        env = {device: self._device_env(device) for device in by_dev}
        sumsq: dict[torch.device, torch.Tensor] = {}
        if need_norm:
            for device, items in by_dev.items():
                ctx, index = env[device]
                sumsq[device] = _cuda_runtime.device_grad_sumsq(
                    _backend.module_for(device),
                    [(b.ptrs["grads"], b.sizes, _backend.DTYPE_CODES[b.grad_dtype]) for _g, b in items],
                    device=device,
                    ctx=ctx,
                    index=index,
                )
            if len(sumsq) > 1:  # one global norm over every device (device-to-device copies, no host sync)
                first = next(iter(sumsq))
                total = sum(t.to(first, non_blocking=True) for t in sumsq.values())
                sumsq = {d: total.to(d, non_blocking=True) for d in sumsq}
        kernel_check = check and not need_norm
        uses_steps = self._uses_steps
        for device, items in by_dev.items():
            module = _backend.module_for(device)
            ctx, index = env[device]
            scale = None
            if grad_scale is not None:
                scale = grad_scale.to(device=device, dtype=torch.float32, non_blocking=True).reshape(1)
            flag = None
            if found_inf is not None or check:
                flag = self._flags.get(device)
                if flag is None:
                    flag = self._flags[device] = torch.zeros(1, dtype=torch.float32, device=device)
                if found_inf is not None:
                    flag.copy_(found_inf.to(device=device, dtype=torch.float32, non_blocking=True).reshape(1))
                else:
                    flag.zero_()
            factor = scale  # multiplies the host divisor inside the kernel (grad_divisor_ptr)
            launch_div = divisor
            if need_norm:
                total_div = divisor if scale is None else scale * divisor
                div, found = _cuda_runtime.clip_divisor_from_sumsq(
                    sumsq[device], divisor=total_div, max_norm=clip_norm
                )
                if clip_norm > 0:
                    factor, launch_div = div, 1.0  # div = divisor * scale * clip, all on the device
                if check:
                    torch.maximum(flag, found, out=flag)
            keep = None
            if uses_steps and flag is not None and not kernel_check:
                keep = 1.0 - flag
            for group, b in items:
                lr, kw = self._device_lr(group, device, {"device": index})
                if factor is not None:
                    kw["grad_divisor_ptr"] = factor.data_ptr()
                if uses_steps:
                    kw["step_ptrs"] = b.step_ptrs
                    if keep is not None:
                        b.steps.add_(keep)
                    else:
                        b.steps.add_(1)
                self._launch(
                    module,
                    b,
                    group,
                    lr,
                    launch_div,
                    0 if flag is None else flag.data_ptr(),
                    kernel_check,
                    ctx,
                    None,
                    kw,
                )
                if uses_steps and kernel_check:
                    b.steps.sub_(
                        flag
                    )  # the kernel's finite check skipped the update: that step does not count
                # SGD's first-run flags are host-side: a skipped first step (device decision) still clears them;
                # with dampening=0 (the default) the first buffer is exact either way (0*momentum + g = g).
                b.clear_first_run()
            if flag is not None:
                self._last_flags.append(flag)
                count = self._skip_counts.get(device)
                if count is None:
                    count = self._skip_counts[device] = torch.zeros(1, dtype=torch.float32, device=device)
                count.add_(flag.ne(0).to(torch.float32))
