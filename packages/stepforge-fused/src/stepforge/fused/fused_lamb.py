# SPDX-License-Identifier: Apache-2.0
"""``FusedLAMB``: multi-tensor LAMB with apex/ColossalAI's signature and math, on CPU and CUDA tensors."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

from stepforge.core import HyperParameterError, check_bool, check_range, check_trust_clip

from . import _backend
from ._adam_base import ADAM_STATE_KEYS, adam_defaults, check_adam_group
from ._base import Bucket, FusedOptimizerBase, Launch
from ._distributed import is_dtensor, shard_dims

__all__ = ["FusedLAMB"]


class FusedLAMB(FusedOptimizerBase):
    """LAMB (You et al., 2019) with apex ``FusedLAMB`` semantics, never overwriting ``p.grad``.

    Per step: the global grad norm over all groups ``N``; ``c = max(1, N/max_grad_norm)`` (no clip when
    ``max_grad_norm`` is 0); then per parameter (``t`` its own step)::

        g = g / (div_scale * c) ;  L2 mode: g = g + wd*p
        m = beta1*m + beta3*g  (beta3 = 1-beta1, or 1 without grad_averaging) ;  v = beta2*v + (1-beta2)*g*g
        u = (m/bc1) / (sqrt(v/bc2) + eps) ;  adam_w_mode: u = u + wd*p
        r = ||p|| / ||u|| if (wd != 0 or use_nvlamb) and both != 0 else 1 ;  r = clamp(r, *trust_clip)
        p = p - lr * r * u

    This is ``stepforge.optim.Lamb.fused_lamb(...)`` (bias_correction_mode="update"), fused.

    Args:
        params, lr, bias_correction, betas, eps, weight_decay, amsgrad (must be False), adam_w_mode,
        grad_averaging, set_grad_none, max_grad_norm, use_nvlamb: apex/ColossalAI ``FusedLAMB``.
        trust_clip: ``(low, high)`` clamp of the trust ratio (either may be None), or None.
        master_weights, skip_nonfinite, assume_stable_grads, capturable: as in
            :class:`~stepforge.fused.FusedAdam`. On CUDA the global norm and clip factor stay on the device.
    """

    _owner = "FusedLAMB"

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        amsgrad: bool = False,
        adam_w_mode: bool = True,
        grad_averaging: bool = True,
        set_grad_none: bool = True,
        max_grad_norm: float = 1.0,
        use_nvlamb: bool = False,
        *,
        trust_clip: tuple[float | None, float | None] | None = None,
        master_weights: bool = False,
        skip_nonfinite: bool | None = None,
        assume_stable_grads: bool = False,
        capturable: bool = False,
    ) -> None:
        defaults = adam_defaults(
            self._owner,
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            adam_w_mode=adam_w_mode,
            grad_averaging=grad_averaging,
            use_nvlamb=use_nvlamb,
        )
        check_bool("set_grad_none", set_grad_none, owner=self._owner)
        check_range(
            "max_grad_norm",
            max_grad_norm,
            low=0.0,
            owner=self._owner,
            hint="Pass 0 to disable global gradient clipping.",
        )
        self.set_grad_none = set_grad_none
        defaults.update(max_grad_norm=max_grad_norm, trust_clip=_trust_bounds(trust_clip))
        super().__init__(
            params,
            defaults,
            master_weights=master_weights,
            skip_nonfinite=skip_nonfinite,
            assume_stable_grads=assume_stable_grads,
            capturable=capturable,
        )

    def _state_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ADAM_STATE_KEYS

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (validated as in the constructor). Sharded DTensor params are refused: the kernel's trust
        ratio needs the norms of the whole parameter and of its whole update, which it computes per tensor."""
        super().add_param_group(param_group)
        for i, p in enumerate(self.param_groups[-1]["params"]):
            if is_dtensor(p) and shard_dims(p):
                self.param_groups.pop()
                raise RuntimeError(
                    f"FusedLAMB: parameter #{i} is a DTensor sharded over {p.placements} (FSDP2 fully_shard); the "
                    "fused LAMB kernel computes each trust ratio from the local shard, which would not equal the "
                    "unsharded run. Use stepforge.optim.Lamb for sharded parameters, or FusedAdam/FusedSGD."
                )

    def _check_group(self, group: dict[str, Any]) -> None:
        super()._check_group(group)
        check_adam_group(
            group, owner=self._owner, flags=("bias_correction", "adam_w_mode", "grad_averaging", "use_nvlamb")
        )
        group["trust_clip"] = _trust_bounds(group["trust_clip"])
        if "max_grad_norm" in group and not _same_number(
            group["max_grad_norm"], self.defaults["max_grad_norm"]
        ):
            raise HyperParameterError(
                f"FusedLAMB: max_grad_norm={group['max_grad_norm']!r} was set on a param group, where it would be "
                f"ignored: the clip uses one global norm over all groups (max_grad_norm="
                f"{self.defaults['max_grad_norm']!r} from the constructor). Pass it to FusedLAMB(...) instead."
            )

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Clear grads; ``set_to_none=None`` follows the constructor's ``set_grad_none``."""
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    def _pre_step(self, plans: list[tuple[dict[str, Any], list[Bucket]]], divisor: float) -> float:
        max_norm = float(self.defaults["max_grad_norm"])
        if max_norm <= 0:
            return divisor
        total = 0.0
        for _group, buckets in plans:
            for b in buckets:
                module = _backend.module_for(b.device)
                norm = module.l2norm(
                    b.ptrs["grads"],
                    b.sizes,
                    _backend.DTYPE_CODES[b.grad_dtype],
                    0,
                    self._ctx(module, b.device),
                    **self._device_kw(b.device),
                )
                total += norm * norm
        global_norm = math.sqrt(total) / divisor
        # inf/NaN grads: no clip factor; the kernel's non-finite check skips (skip_nonfinite) or they propagate.
        if math.isfinite(global_norm) and global_norm > max_norm:
            divisor *= global_norm / max_norm
        return divisor

    def _device_clip_norm(self) -> float:
        return float(self.defaults["max_grad_norm"])

    def _launch(
        self, module: ModuleType, bucket: Bucket, group: dict[str, Any], launch: Launch
    ) -> bool | None:
        beta1, beta2 = group["betas"]
        low, high = group.get("trust_clip", (0.0, math.inf))
        return module.lamb(
            bucket.ptrs["params"],
            bucket.ptrs["grads"],
            bucket.ptrs["exp_avg"],
            bucket.ptrs["exp_avg_sq"],
            bucket.ptrs.get("masters"),
            bucket.sizes,
            launch.steps,
            _backend.DTYPE_CODES[bucket.param_dtype],
            _backend.DTYPE_CODES[bucket.grad_dtype],
            launch.lr,
            float(beta1),
            float(beta2),
            float(group["eps"]),
            float(group["weight_decay"]),
            bool(group["adam_w_mode"]),
            bool(group["bias_correction"]),
            bool(group["grad_averaging"]),
            bool(group["use_nvlamb"]),
            float(low),
            float(high),
            launch.divisor,
            launch.found_inf_ptr,
            launch.check_finite,
            launch.ctx,
            **launch.kw,
        )

    def step(self, closure: Callable[[], Any] | None = None, div_scale: float = -1) -> Any:
        """One optimizer step; ``div_scale > 0`` divides every grad before the norm clip."""
        return self._fused_step(closure, div_scale)


def _same_number(a: Any, b: Any) -> bool:
    try:
        return float(a) == float(b)
    except (TypeError, ValueError):
        return False


def _trust_bounds(trust_clip: Any) -> tuple[float, float]:
    """``trust_clip`` as the kernel takes it: ``(low, high)`` floats, ``None`` parts as 0 and inf."""
    bounds = check_trust_clip(trust_clip, owner="FusedLAMB")
    if bounds is None:
        return 0.0, math.inf
    low, high = bounds
    return (0.0 if low is None else low), (math.inf if high is None else high)
