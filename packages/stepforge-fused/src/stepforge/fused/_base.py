# SPDX-License-Identifier: Apache-2.0
"""The base class of the fused optimizers: options, add_param_group, subclass hooks and step routing.

It owns the stateful parts of the step machinery (:mod:`._step`): :class:`~._step.buckets.BucketCache` (buckets,
the pointer cache and its per-step revalidation), :class:`~._step.eager.SkipTracker` (skipped-step reporting) and
:class:`~._step.device.DeviceLoop` (the sync-free CUDA step). They reach the optimizer through
:class:`~._step.protocol.KernelOwner`. :mod:`._state` keeps torch.optim state-dict compatibility. Subclasses define
``_owner`` and ``_kernel`` (the :class:`~._backend.KernelSpec` both the eager and the compiled step call).
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import Any

import torch

from stepforge.core import GroupValidator, HyperParameterError, check_bool, check_lr

from ._backend import KernelSpec, device_env, device_kw, device_path, launch_ctx
from ._state import StateMixin
from ._step.buckets import Bucket, BucketCache, Launch
from ._step.compiled import init_group, prepare_fallback
from ._step.device import DeviceLoop
from ._step.eager import SkipTracker, fused_step, launch
from ._validate import check_param

__all__ = ["Bucket", "FusedOptimizerBase", "Launch"]


class FusedOptimizerBase(StateMixin, torch.optim.Optimizer):
    """Base class of the stepforge fused optimizers (not public API).

    Subclasses define ``_owner`` (class name for messages) and ``_kernel`` (a :class:`~._backend.KernelSpec`:
    the state tensors and hyper-parameters of their kernel), and may override ``_state_keys(group)``,
    set ``_pre_step(buckets_by_group, divisor)`` (LAMB's global norm, host path) and
    ``_device_clip_norm()`` (the same clip on the CUDA path).

    Attributes:
        master_weights, skip_nonfinite, assume_stable_grads: the constructor's options.
        grad_scale, found_inf: set by ``torch.amp.GradScaler`` around ``step()`` and deleted after it (absent
            otherwise: GradScaler multiplies an existing ``grad_scale``, so there is no class default).
    """

    _owner = "FusedOptimizer"
    #: the kernel this optimizer calls, eagerly and compiled (its argument specification)
    _kernel: KernelSpec
    # False for SGD: torch.optim.SGD keeps no per-parameter step.
    _uses_steps = True
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

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        if set_to_none:
            self._bucket_cache.release_grads()

    # ---- hooks for subclasses --------------------------------------------------------------------------
    def _state_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        """The float32 state tensors of ``group``'s params, in kernel order (those of :attr:`_kernel`)."""
        return self._kernel.state_keys

    #: the eager step's kernel call on one bucket (``opt._kernel`` with a :class:`Launch`'s scalars; returns
    #: whether the kernel's finite check skipped the update): a function of so the host loop
    #: goes straight to the kernel module; FusedLAMB overrides it for sharded buckets.
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

    # ---- step routing --------------------------------------------------------------------------------------
    def _init_group(
        self,
        group: dict[str, Any],
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        state_a: list[torch.Tensor],
        state_b: list[torch.Tensor],
        masters: list[torch.Tensor],
        extras: list[torch.Tensor],
    ) -> tuple[tuple[Any, ...], ...]:
        """What ``torch.compile`` runs eagerly while tracing ``step()``: validate ``group``, create its state and
        fill the (empty) lists bucket by bucket; returns the bucket plans (:mod:`._step.compiled`)."""
        self._groups.revalidate(self.param_groups)
        return init_group(self, group, params, grads, state_a, state_b, masters, extras)  # type: ignore[arg-type]
