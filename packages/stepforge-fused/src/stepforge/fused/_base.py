# SPDX-License-Identifier: Apache-2.0
"""The base class of the fused optimizers: options, add_param_group, subclass hooks and step routing.

It owns the stateful parts of the step machinery (:mod:`._step`): :class:`~._step.buckets.BucketCache` (buckets,
the pointer cache and its per-step revalidation), :class:`~._step.device.SkipTracker` (skipped-step reporting) and
:class:`~._step.device.DeviceLoop` (the sync-free CUDA step). They reach the optimizer through
:class:`~._step.protocol.KernelOwner`. It keeps torch.optim's state layout and state-dict format (a
``torch.optim.AdamW``/``SGD`` checkpoint loads into the fused classes and back): ``step`` 0-dim float32, state
tensors float32 shaped like their parameter, created on its device and moved when it moves. Subclasses define
``_owner`` and ``_kernel`` (the :class:`~._backend.KernelSpec` both the eager and the compiled step call).
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import Any

import torch

from stepforge.core import GroupValidator, HyperParameterError, check_bool, check_lr

from ._backend import KernelSpec, device_env, device_kw, device_path, launch_ctx
from ._huge_pages import float32_copy, float32_zeros_like
from ._step.buckets import Bucket, BucketCache, Launch
from ._step.compiled import init_group, prepare_fallback
from ._step.device import DeviceLoop, SkipTracker
from ._step.eager import fused_step, launch
from ._validate import check_param

__all__ = ["Bucket", "FusedOptimizerBase", "Launch"]


class FusedOptimizerBase(torch.optim.Optimizer):
    """Base class of the stepforge fused optimizers (not public API): the constructor's options
    (``master_weights``, ``skip_nonfinite``, ``assume_stable_grads``, ``set_grad_none``) and the subclass hooks. ``grad_scale`` and
    ``found_inf`` are set by ``torch.amp.GradScaler`` around ``step()`` only (no class default: GradScaler
    multiplies an existing ``grad_scale``)."""

    _owner = "FusedOptimizer"
    #: the kernel this optimizer calls, eagerly and compiled (its argument specification)
    _kernel: KernelSpec
    # False for SGD: torch.optim.SGD keeps no per-parameter step.
    _uses_steps = True
    #: the options pickled besides what torch.optim pickles
    _PICKLED_OPTIONS = ("master_weights", "skip_nonfinite", "assume_stable_grads", "set_grad_none")

    # GradScaler calls step() without unscaling and sets `grad_scale` / `found_inf` on the optimizer instead.
    _step_supports_amp_scaling = True

    _bucket_cache: BucketCache
    _skips: SkipTracker
    _device_loop: DeviceLoop
    #: ``id(group)`` -> SGD first-run flag tensors a compiled step reads (kept alive here; see _step.compiled)
    _compile_first_run: dict[int, list[torch.Tensor]]

    def __init__(
        self,
        params: Any,
        defaults: dict[str, Any],
        *,
        master_weights: bool = False,
        skip_nonfinite: bool | None = None,
        assume_stable_grads: bool = False,
        capturable: bool = False,
        set_grad_none: bool = True,
    ):
        owner = self._owner
        if check_bool("capturable", capturable, owner=owner):
            # A group option, as in torch.optim (recorded in state_dict(); checked per group at step time).
            defaults = {**defaults, "capturable": True}
        check_bool("master_weights", master_weights, owner=owner)
        check_bool("assume_stable_grads", assume_stable_grads, owner=owner)
        check_bool("set_grad_none", set_grad_none, owner=owner)
        if skip_nonfinite is not None:
            check_bool("skip_nonfinite", skip_nonfinite, owner=owner)
        self.master_weights = master_weights
        self.skip_nonfinite = skip_nonfinite
        self.assume_stable_grads = assume_stable_grads
        self.set_grad_none = set_grad_none
        self._own_parts()
        super().__init__(params, defaults)

    def _own_parts(self, skips: SkipTracker | None = None) -> None:
        """Create the objects that do the step's work (at construction and after unpickling)."""
        self._bucket_cache = BucketCache(self.assume_stable_grads)
        self._skips = skips if skips is not None else SkipTracker()
        self._device_loop = DeviceLoop()
        self._groups = GroupValidator(self._check_group, owner=self._owner)
        self._compile_first_run = {}
        prepare_fallback(fused_step)

    def __getstate__(self) -> dict[str, Any]:
        # torch.optim pickles defaults/state/param_groups only; keep our options, never the pointer caches.
        state = super().__getstate__()
        state.update({k: self.__dict__[k] for k in self._PICKLED_OPTIONS if k in self.__dict__})
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("master_weights", False)
        self.__dict__.setdefault("skip_nonfinite", None)
        self.__dict__.setdefault("assume_stable_grads", False)
        self.__dict__.setdefault("set_grad_none", True)
        skips = SkipTracker(
            bool(self.__dict__.pop("last_step_skipped", False)), int(self.__dict__.pop("skipped_steps", 0))
        )
        self._own_parts(skips)

    # ---- skip reporting ------------------------------------------------------------------------------------
    # On CUDA the skip decision stays on the device (no sync inside step()); these properties read it back
    # only when asked, so reading them after a CUDA step synchronises with the stream.
    @property
    def last_step_skipped(self) -> bool:
        """Whether the last ``step()`` was skipped (inf/NaN grads, or GradScaler's ``found_inf``)."""
        return self._skips.last_skipped()

    @last_step_skipped.setter
    def last_step_skipped(self, value: bool) -> None:
        self._skips.set_last(value)

    @property
    def skipped_steps(self) -> int:
        """How many ``step()`` calls were skipped so far (device counters included, read on access)."""
        return self._skips.skipped()

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._skips.set_skipped(value)

    def invalidate_cache(self) -> None:
        """Forget the cached pointer arrays (needed only after swapping storage under a param or grad)."""
        self._bucket_cache.invalidate()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group: its values (defaults filled in) are validated like the constructor's, and its
        parameters must be float32/float16/bfloat16 and contiguous; on error nothing is added."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            self._groups.validate(group, len(self.param_groups) - 1)
            for i, p in enumerate(group["params"]):
                check_param(p, i, owner=self._owner)
        except Exception:
            self.param_groups.pop()
            raise
        self._bucket_cache.invalidate()

    def _check_group(self, group: MutableMapping[str, Any]) -> None:
        """Validate (and normalise) one param group's values; subclasses extend it. Raises
        ``HyperParameterError`` naming the value and the fix."""
        check_lr(group["lr"], owner=self._owner)
        if "capturable" in group:
            check_bool("capturable", group["capturable"], owner=self._owner)

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Clear grads; ``set_to_none=None`` follows the constructor's ``set_grad_none`` (default True)."""
        set_to_none = self.set_grad_none if set_to_none is None else set_to_none
        super().zero_grad(set_to_none=set_to_none)
        if set_to_none:
            self._bucket_cache.release_grads()

    # ---- hooks for subclasses --------------------------------------------------------------------------
    def _state_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        """The float32 state tensors of ``group``'s params, in kernel order (those of :attr:`_kernel`)."""
        return self._kernel.state_keys

    #: the eager step's kernel call on one bucket; FusedLAMB overrides it for sharded buckets
    _launch = launch

    #: optional hook ``_pre_step(plans, divisor) -> divisor`` adjusting the host grad divisor before any update
    #: (FusedLAMB's global grad-norm clip); None: no adjustment
    _pre_step: Callable[[list[tuple[dict[str, Any], list[Bucket]]], float], float] | None = None

    def _device_clip_norm(self) -> float:
        """Global grad-norm clip threshold applied on the device path (LAMB); ``0`` = none."""
        return 0.0

    # Device helpers, reached through the optimizer so a test can route a device to an emulation.
    _device_path = staticmethod(device_path)
    _device_env = staticmethod(device_env)
    _device_kw = staticmethod(device_kw)
    _ctx = staticmethod(launch_ctx)

    #: what ``torch.compile`` runs eagerly while tracing ``step()`` (dynamo knows optimizers' ``_init_group``):
    #: validate, create the state and fill the (empty) lists bucket by bucket; returns the bucket plans
    _init_group = init_group

    # ---- state: torch.optim's layout and state dicts ---------------------------------------------------------
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of this class or of ``torch.optim.AdamW``/``Adam``/``SGD`` (same state layout).

        Group options missing from ``state_dict`` (e.g. ``bias_correction`` in a torch checkpoint) keep this
        optimizer's current values, so a torch checkpoint never raises ``KeyError`` (apex #577); ``capturable``
        always keeps this optimizer's value. Steps saved on the CPU (torch's non-fused layout) move to a CUDA
        parameter's device at the next step (one copy), steps saved on a device are used in place.
        """
        self._check_loadable(state_dict)
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
        self._groups.forget()
        for i, group in enumerate(self.param_groups):
            self._groups.validate(group, i)
        self._bucket_cache.invalidate()

    #: state keys a loaded state may hold besides ``step``, ``master_param`` and ``_state_keys(group)``.
    _extra_state_keys: tuple[str, ...] = ()

    def _check_loadable(self, state_dict: dict[str, Any]) -> None:
        """Refuse, before anything changes, a state of another optimizer or of other parameters: every state
        key must be one this class uses and every state tensor must have its parameter's shape."""
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise ValueError(
                f"{self._owner}.load_state_dict: expected a dict with 'state' and 'param_groups' "
                "(what optimizer.state_dict() returns)."
            )
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"{self._owner}.load_state_dict: the state has {len(saved_groups)} param groups, this optimizer "
                f"{len(self.param_groups)}."
            )
        for gi, (saved, group) in enumerate(zip(saved_groups, self.param_groups, strict=True)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    f"{self._owner}.load_state_dict: param group #{gi} has {len(saved['params'])} parameters in "
                    f"the state and {len(group['params'])} here."
                )
            allowed = {"step", "master_param", *self._state_keys(group), *self._extra_state_keys}
            for pi, (pid, p) in enumerate(zip(saved["params"], group["params"], strict=True)):
                entry = state_dict["state"].get(pid)
                if not entry:
                    continue
                for key, value in entry.items():
                    if key not in allowed:
                        raise ValueError(
                            f"{self._owner}.load_state_dict: state key {key!r} of parameter #{pi} (group {gi}) is "
                            f"not one {self._owner} uses ({', '.join(sorted(allowed))}); the state was saved by "
                            "another optimizer. Load it into that optimizer, or start this one afresh."
                        )
                    if key != "step" and isinstance(value, torch.Tensor) and value.shape != p.shape:
                        raise ValueError(
                            f"{self._owner}.load_state_dict: state[{key!r}] of parameter #{pi} (group {gi}) has "
                            f"shape {tuple(value.shape)}, the parameter {tuple(p.shape)}; the state belongs to "
                            "other parameters."
                        )

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
                state[key] = float32_zeros_like(p)
                fresh = True
            elif buf.dtype != torch.float32 or buf.device != p.device or not buf.is_contiguous():
                # A torch checkpoint of fp16/bf16 params keeps low-precision moments: widen them (exact).
                state[key] = buf.to(device=p.device, dtype=torch.float32).contiguous()
            if state[key].shape != p.shape:
                raise RuntimeError(
                    f"{self._owner}: a parameter was given new storage of shape {tuple(p.shape)} but its "
                    f"state['{key}'] has shape {tuple(state[key].shape)}; state cannot follow a change of size. "
                    "Start it afresh with `del optimizer.state[param]` (or rebuild the optimizer)."
                    if moved
                    else f"{self._owner}: state['{key}'] has shape {tuple(state[key].shape)} but its parameter "
                    f"has shape {tuple(p.shape)}; the loaded state does not belong to these parameters."
                )
        if self.master_weights and p.dtype != torch.float32:
            w = state.get("master_param")
            if w is None or w.shape != p.shape:
                state["master_param"] = float32_copy(p)
            else:
                if w.dtype != torch.float32 or w.device != p.device or not w.is_contiguous():
                    w = state["master_param"] = w.to(device=p.device, dtype=torch.float32).contiguous()
                if moved and not torch.equal(w.to(p.dtype), p.detach()):
                    # new values were put into the parameter (p.data = t, a load): they win over the master
                    w.copy_(p.detach())
        elif "master_param" in state:
            # the parameter became float32 (model.float()): it is its own master now, as in torch.optim
            del state["master_param"]
        self._adopt_state(p, state)
        return state, fresh

    def _adopt_state(self, p: torch.Tensor, state: dict[str, Any]) -> None:
        """Hook called once ``p``'s state tensors exist: a subclass may move them (CPUAdam's NVMe offload)."""
