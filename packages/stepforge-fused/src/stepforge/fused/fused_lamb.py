# SPDX-License-Identifier: Apache-2.0
"""``FusedLAMB``: multi-tensor LAMB with apex/ColossalAI's signature and math, on CPU and CUDA tensors."""

from __future__ import annotations

import array
import dataclasses
import math
from collections.abc import Callable, Iterable, MutableMapping
from types import ModuleType
from typing import Any, NamedTuple

import torch

from stepforge.core import HyperParameterError, check_range, check_trust_clip

from ._backend import LAMB
from ._base import Bucket, FusedOptimizerBase, Launch
from ._distributed import comm_device, is_dtensor, mesh_sum_, shard_dims, shard_groups
from ._step.eager import fused_step, grad_norm, launch
from ._validate import adam_defaults, check_adam_group

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

    DTensor parameters (FSDP2 ``fully_shard``, CPU): the kernels step the local shards; ``||p||``, ``||u||`` of
    each sharded parameter and the global grad norm are summed over the mesh dimensions it is sharded on, so the
    result equals the unsharded run up to the summation order of those norms. The kernel then runs in two calls
    (a norms pass, the all-reduce, an apply pass); unsharded buckets keep the single call.

    - ``params``, ``lr``, ``bias_correction``, ``betas``, ``eps``, ``weight_decay``, ``adam_w_mode``,
      ``grad_averaging``, ``set_grad_none``, ``max_grad_norm``, ``use_nvlamb``: as apex/ColossalAI ``FusedLAMB``.
    - ``master_weights``, ``skip_nonfinite``, ``assume_stable_grads``, ``capturable``: as in
      :class:`~stepforge.fused.FusedAdam` (on CUDA the global norm and clip factor stay on the device).

    Args:
        amsgrad: must be False (apex's argument).
        trust_clip: ``(low, high)`` clamp of the trust ratio (either may be None), or None.
    """

    _owner = "FusedLAMB"
    _kernel = LAMB
    #: the buckets the shard plans were made for (kept referenced so their ids stay theirs)
    _shard_buckets: list[Bucket]
    #: ``id(bucket)`` -> its sharded DTensor params (buckets without any are absent)
    _shard_plans: dict[int, _ShardPlan]

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
        check_range(
            "max_grad_norm",
            max_grad_norm,
            low=0.0,
            owner=self._owner,
            hint="Pass 0 to disable global gradient clipping.",
        )
        defaults.update(max_grad_norm=max_grad_norm, trust_clip=_trust_bounds(trust_clip))
        super().__init__(
            params,
            defaults,
            master_weights=master_weights,
            skip_nonfinite=skip_nonfinite,
            assume_stable_grads=assume_stable_grads,
            capturable=capturable,
            set_grad_none=set_grad_none,
        )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (validated as in the constructor). Sharded DTensor params on CUDA are refused: the
        device path does not reduce the per-tensor norms over the mesh (CPU shards are supported)."""
        super().add_param_group(param_group)
        for i, p in enumerate(self.param_groups[-1]["params"]):
            if is_dtensor(p) and shard_dims(p) and p.device.type != "cpu":
                self.param_groups.pop()
                raise RuntimeError(
                    f"FusedLAMB: parameter #{i} is a DTensor sharded over {p.placements} on {p.device}; "
                    "sharded FusedLAMB reduces its trust-ratio norms over the mesh on the CPU path only. Keep "
                    "the sharded parameters on the CPU (FSDP2 CPU offload), or use stepforge.optim.Lamb."
                )
        self._shard_buckets: list[Bucket] = []
        self._shard_plans: dict[int, _ShardPlan] = {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        # the sharded-norm caches are not pickled (like the bucket cache): the next step rebuilds them
        self._shard_buckets = []
        self._shard_plans = {}

    def _check_group(self, group: MutableMapping[str, Any]) -> None:
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

    def _pre_step(self, plans: list[tuple[dict[str, Any], list[Bucket]]], divisor: float) -> float:
        buckets = [b for _group, bs in plans for b in bs]
        self._refresh_shard_plans(buckets)
        max_norm = float(self.defaults["max_grad_norm"])
        if max_norm <= 0:
            return divisor
        total = 0.0
        mesh_sets: dict[tuple[int, ...], _MeshSet] = {}
        parts: dict[tuple[int, ...], list[float]] = {}  # per set of mesh groups: the local sums of squares
        for b in buckets:
            plan = self._shard_plans.get(id(b))
            if plan is None:
                total += grad_norm(self, b) ** 2
                continue
            for mesh_set in plan.sets:
                idx = mesh_set.positions
                sq = grad_norm(self, b, _pick(b.ptrs["grads"], idx), _pick(b.sizes, idx)) ** 2
                mesh_sets[mesh_set.key] = mesh_set
                parts.setdefault(mesh_set.key, []).append(sq)
            if plan.rest:
                total += grad_norm(self, b, _pick(b.ptrs["grads"], plan.rest), _pick(b.sizes, plan.rest)) ** 2
        # sharded grads: each rank holds a part of the sum of squares; one all-reduce per set of mesh groups
        for key, mesh_set in mesh_sets.items():
            local = torch.tensor([math.fsum(parts[key])], dtype=torch.float64)
            total += float(mesh_sum_(local, mesh_set.groups, mesh_set.comm).item())
        global_norm = math.sqrt(total) / divisor
        # inf/NaN grads: no clip factor; the kernel's non-finite check skips (skip_nonfinite) or they propagate.
        if math.isfinite(global_norm) and global_norm > max_norm:
            divisor *= global_norm / max_norm
        return divisor

    def _refresh_shard_plans(self, buckets: list[Bucket]) -> None:
        """Which tensors of each bucket are sharded DTensors, and over which mesh groups (rebuilt when the
        buckets are; the buckets are kept referenced so their ids stay theirs)."""
        old = self._shard_buckets
        if len(old) == len(buckets) and all(a is b for a, b in zip(old, buckets, strict=True)):
            return
        self._shard_buckets = buckets
        self._shard_plans = {}
        for b in buckets:
            plan = _shard_plan(b.params)
            if plan is not None:
                self._shard_plans[id(b)] = plan

    def _device_clip_norm(self) -> float:
        return float(self.defaults["max_grad_norm"])

    def _launch(self, module: ModuleType, bucket: Bucket, group: dict[str, Any], at: Launch) -> bool | None:  # type: ignore[override]
        plan = self._shard_plans.get(id(bucket)) if self._shard_plans else None
        if plan is None or bucket.on_device:
            return launch(self, module, bucket, group, at)  # type: ignore[no-any-return]
        # Sharded tensors: moments and the local sums of p^2, u^2; the sums over the mesh; then the update.
        n = len(bucket.sizes)
        norms = torch.zeros(2 * n, dtype=torch.float64)
        if launch(self, module, bucket, group, at, norms_out_ptr=norms.data_ptr()):
            return True
        sums = norms.view(2, n)
        for mesh_set in plan.sets:
            pos = torch.tensor(mesh_set.positions, dtype=torch.long)
            sums[:, pos] = mesh_sum_(sums[:, pos], mesh_set.groups, mesh_set.comm)
        kw = {k: v for k, v in at.kw.items() if k != "write_unscaled_grads"}  # written back by the norms pass
        apply = dataclasses.replace(at, found_inf_ptr=0, check_finite=False, kw=kw)
        skipped: bool | None = launch(self, module, bucket, group, apply, norms_in_ptr=norms.data_ptr())
        return skipped

    def step(self, closure: Callable[[], Any] | None = None, div_scale: float = -1) -> Any:
        """One optimizer step; ``div_scale > 0`` divides every grad before the norm clip."""
        return fused_step(self, closure, div_scale)


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


def _pick(values: array.array[int], idx: list[int]) -> array.array[int]:
    return array.array("q", [values[i] for i in idx])


class _MeshSet(NamedTuple):
    """The tensors of a bucket sharded over the same mesh ``groups`` (``key``: their ids): their ``positions``
    in the bucket, and the device their collectives run on (``comm``)."""

    key: tuple[int, ...]
    groups: list[Any]
    comm: torch.device
    positions: list[int]


class _ShardPlan(NamedTuple):
    """A bucket's sharded DTensor params, one :class:`_MeshSet` per distinct set of mesh groups, and ``rest``, the
    positions of the other (plain or replicated) tensors."""

    sets: list[_MeshSet]
    rest: list[int]


def _shard_plan(params: list[Any]) -> _ShardPlan | None:
    by_key: dict[tuple[int, ...], _MeshSet] = {}
    rest: list[int] = []
    for i, p in enumerate(params):
        if not (is_dtensor(p) and shard_dims(p)):
            rest.append(i)
            continue
        groups = shard_groups(p)
        key = tuple(id(g) for g in groups)
        by_key.setdefault(key, _MeshSet(key, groups, comm_device(p), [])).positions.append(i)
    return _ShardPlan(list(by_key.values()), rest) if by_key else None
