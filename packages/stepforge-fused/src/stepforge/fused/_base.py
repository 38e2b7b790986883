# SPDX-License-Identifier: Apache-2.0
"""The base class of the fused optimizers: options, skip reporting, subclass hooks and step routing.

The pieces live beside it: :mod:`._buckets` (buckets, the pointer cache and its per-step revalidation),
:mod:`._state` (torch.optim state-dict compatibility and state creation), :mod:`._device_step` (the sync-free
CUDA step). Subclasses define ``_owner``, ``_state_keys(group)`` and ``_launch(module, bucket, group, launch)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from stepforge.core import GroupValidator, HyperParameterError, check_bool, check_lr, check_range

from . import _backend
from ._buckets import Bucket, BucketsMixin, GroupCache, Launch
from ._device_step import DeviceStepMixin
from ._distributed import is_dtensor, mesh_all_true
from ._state import StateMixin
from ._validate import check_param, local_tensor

__all__ = ["Bucket", "FusedOptimizerBase", "Launch"]

_NO_KW: dict[str, Any] = {}


class FusedOptimizerBase(StateMixin, BucketsMixin, DeviceStepMixin, torch.optim.Optimizer):
    """Base class of the stepforge fused optimizers (not public API).

    Subclasses define ``_owner`` (class name for messages), ``_state_keys(group)`` (float32 state tensors
    shaped like the param), ``_launch(module, bucket, group, launch)`` (``launch``: a :class:`Launch`), and may
    override ``_pre_step(buckets_by_group, divisor)`` (LAMB's global norm, host path) and
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
        self._cache: dict[int, GroupCache] = {}
        self._groups = GroupValidator(self._check_group, owner=self._owner)
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
        if hasattr(self, "_cache"):
            self._cache.clear()

    def _check_group(self, group: dict[str, Any]) -> None:
        """Validate (and normalise) one param group's values; subclasses extend it. Raises
        ``HyperParameterError`` naming the value and the fix."""
        check_lr(group["lr"], owner=self._owner)
        if "capturable" in group:
            check_bool("capturable", group["capturable"], owner=self._owner)

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
        self, module: ModuleType, bucket: Bucket, group: dict[str, Any], launch: Launch
    ) -> bool | None:
        """Call the kernel of this optimizer on ``bucket`` with the scalars in ``launch``; returns whether the
        kernel's finite check skipped the update."""
        raise NotImplementedError

    def _pre_step(self, plans: list[tuple[dict[str, Any], list[Bucket]]], divisor: float) -> float:
        """Adjust the grad divisor before any update (LAMB: global grad-norm clip). Returns the divisor."""
        return divisor

    # ---- step ----------------------------------------------------------------------------------------------

    @torch.no_grad()
    def _fused_step(self, closure: Callable[[], Any] | None, div_scale: float = -1) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        divisor = 1.0
        if div_scale is not None and div_scale != -1:
            divisor = check_range(
                "div_scale",
                div_scale,
                low=0.0,
                low_open=True,
                high=math.inf,
                high_open=True,
                owner=f"{self._owner}.step()",
                hint="It divides every gradient (a loss scale); pass -1 (the default) for no division.",
            )
        self._groups.revalidate(self.param_groups)
        # GradScaler's scale: after a step that is not skipped the grads hold g / scale, as torch's fused
        # optimizers leave them (written back by the kernel in the same pass when it divides by exactly that).
        unscale_by: float | None = None
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
            unscale_by = float(grad_scale)
            divisor *= unscale_by
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
            unscale_by = float(grad_scale) * (unscale_by or 1.0)
            divisor *= float(grad_scale)
        # The whole step is skipped on a non-finite grad: with several buckets, check all of them first.
        pre_checked = False
        sharded = any(b.params and is_dtensor(b.params[0]) for _group, b in buckets)
        if check and (len(buckets) > 1 or sharded):
            finite = True
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
                finite = finite and math.isfinite(norm / divisor)
            if sharded:  # every rank holding a shard must take the same decision
                finite = mesh_all_true(finite, [b.params[0] for _g, b in buckets if b.params])
            if not finite:
                self._skip_on_host()
                return loss
            pre_checked = True
        divisor = self._pre_step(plans, divisor)
        kernel_unscale = unscale_by is not None and divisor == unscale_by
        host_kw = {"write_unscaled_grads": True} if kernel_unscale else _NO_KW
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
                kw.update(host_kw)
                skipped = self._launch(
                    module, b, group, Launch(lr, divisor, 0, check and not pre_checked, ctx, None, kw)
                )
                if skipped and uses_steps:
                    b.steps.sub_(1)
            else:
                launch = Launch(
                    float(group["lr"]), divisor, 0, check and not pre_checked, ctx, b.prepare_steps(), host_kw
                )
                skipped = self._launch(module, b, group, launch)
                if not skipped and uses_steps:
                    b.steps.add_(1)
            if skipped:
                # Only possible on the first (single) bucket: nothing has been written yet.
                self._skip_on_host()
                return loss
            b.clear_first_run()
        if unscale_by is not None and not kernel_unscale:
            # the kernels divided by more than the scale (div_scale, LAMB's clip): unscale in a second pass
            for _group, b in buckets:
                grads = [local_tensor(p.grad) for p in b.params]
                if grads:
                    torch._foreach_div_(grads, unscale_by)
        return loss
