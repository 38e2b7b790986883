# SPDX-License-Identifier: Apache-2.0
"""The eager step of the fused optimizers: what every gradient is divided by (AMP), which steps were skipped, the
host loop over CPU buckets (and, in HybridAdam, CUDA buckets beside them) and the one kernel call per bucket
(:func:`launch`); an all-CUDA step goes to the sync-free device loop (:mod:`.device`).

``torch.amp.GradScaler`` calls ``step()`` without unscaling (``_step_supports_amp_scaling``) and sets
``grad_scale`` / ``found_inf`` on the optimizer. Host values are read at once; CUDA tensors stay on the device
for the sync-free path and are read only if the step falls back to the host loop (HybridAdam's mixed buckets).
After a step that is not skipped the grads hold ``g / scale``, as torch's fused optimizers leave them: written
back by the kernel in the same pass when it divides by exactly the scale, otherwise in a second pass. Skips
decided on a device stay there (flag tensors), read only when asked.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, cast

import torch

from stepforge.core import HyperParameterError
from stepforge.core.torch_compat import dtensor_local

from .. import _backend
from .._backend import DTYPE_CODES, call_kernel
from .._distributed import is_dtensor, mesh_all_true
from .._validate import div_scale_divisor
from .buckets import Bucket, Launch
from .compiled import traced_step
from .device import SkipTracker

if TYPE_CHECKING:
    from .protocol import KernelOwner

__all__ = [
    "UnscalePlan",
    "all_finite",
    "fused_step",
    "grad_norm",
    "launch",
    "plan_unscale",
    "run_host",
    "unscale_grads",
]

_NO_KW: dict[str, Any] = {}


@dataclass(slots=True)
class UnscalePlan:
    """One step's division of the gradients: the host ``divisor`` (``div_scale`` x a host GradScaler scale),
    ``unscale_by`` (GradScaler's scale read on the host: ``p.grad`` must end as ``g / unscale_by``), GradScaler's
    ``grad_scale``/``found_inf`` still on a device (sync-free path), and ``skip`` (a raised host ``found_inf``)."""

    divisor: float
    unscale_by: float | None = None
    grad_scale: torch.Tensor | None = None
    found_inf: torch.Tensor | None = None
    skip: bool = False

    def check_divisor(self, owner: str) -> None:
        """Refuse a non-positive or non-finite total divisor (a GradScaler scale of 0 or inf)."""
        if not math.isfinite(self.divisor) or self.divisor <= 0:
            raise HyperParameterError(
                f"{owner}: the gradient divisor must be positive and finite, got {self.divisor}"
            )

    def to_host(self) -> bool:
        """Read the device-resident GradScaler values (the host loop decides skips on the host); returns
        whether the step is skipped (``found_inf`` raised)."""
        if self.found_inf is not None and float(self.found_inf) != 0.0:
            return True
        self.found_inf = None
        if self.grad_scale is not None:
            scale = float(self.grad_scale)
            self.unscale_by = scale * (self.unscale_by or 1.0)
            self.divisor *= scale
            self.grad_scale = None
        return False

    def kernel_writes_back(self, divisor: float) -> bool:
        """Whether the kernels, dividing by ``divisor``, can store ``g / scale`` in the same pass."""
        return self.unscale_by is not None and divisor == self.unscale_by


def plan_unscale(
    opt: KernelOwner,
    divisor: float,
    grad_scale: torch.Tensor | float | None,
    found_inf: torch.Tensor | float | None,
) -> UnscalePlan:
    """The step's plan from GradScaler's ``grad_scale``/``found_inf``: values that live on the host (or on a
    device without the sync-free path) are read now, device tensors are kept for the device loop."""
    plan = UnscalePlan(divisor)
    if found_inf is not None and not (
        isinstance(found_inf, torch.Tensor) and opt._device_path(found_inf.device)
    ):
        if float(found_inf) != 0.0:
            plan.skip = True
            return plan
        found_inf = None
    if grad_scale is not None and not (
        isinstance(grad_scale, torch.Tensor) and opt._device_path(grad_scale.device)
    ):
        plan.unscale_by = float(grad_scale)
        plan.divisor *= plan.unscale_by
        grad_scale = None
    plan.grad_scale = grad_scale
    plan.found_inf = found_inf
    return plan


def unscale_grads(buckets: list[Bucket], unscale_by: float) -> None:
    """Second pass: divide every grad of ``buckets`` by GradScaler's scale."""
    for b in buckets:
        grads = [dtensor_local(cast(torch.Tensor, p.grad)) for p in b.params]  # bucketed: has a grad
        if grads:
            torch._foreach_div_(grads, unscale_by)


def launch(
    opt: KernelOwner, module: ModuleType, bucket: Bucket, group: dict[str, Any], at: Launch, **kw: Any
) -> Any:
    """The eager step's call of ``opt``'s kernel (``opt._kernel``) on ``bucket`` (its cached pointer arrays) with
    the scalars in ``at`` (the optimizers' default ``_launch``); ``kw``: more binding keywords (LAMB's norms).
    Returns the kernel's answer: whether its finite check skipped the update (None: decided on the device)."""
    spec = opt._kernel
    ptrs = bucket.ptrs
    return call_kernel(
        module,
        spec,
        [ptrs["params"], ptrs["grads"], *map(ptrs.get, spec.state_keys), ptrs.get("masters")],
        bucket.sizes,
        bucket.first_run if spec.first_run else at.steps,
        (DTYPE_CODES[bucket.param_dtype], DTYPE_CODES[bucket.grad_dtype]),
        at.lr,
        spec.values(group),
        at.divisor,
        at.found_inf_ptr,
        at.check_finite,
        at.ctx,
        **({**at.kw, **kw} if kw else at.kw),
    )


def grad_norm(opt: KernelOwner, b: Bucket, ptrs: Any = None, sizes: Any = None) -> float:
    """The L2 norm of ``b``'s grads (or of the grads at ``ptrs``, of ``sizes``), read on the host."""
    module = _backend.module_for(b.device)
    ptrs, sizes = (b.ptrs["grads"], b.sizes) if ptrs is None else (ptrs, sizes)
    code = DTYPE_CODES[b.grad_dtype]
    return float(module.l2norm(ptrs, sizes, code, 0, opt._ctx(module, b.device), **opt._device_kw(b.device)))


def all_finite(
    opt: KernelOwner, buckets: list[tuple[dict[str, Any], Bucket]], divisor: float, sharded: bool
) -> bool:
    """Whether every grad of ``buckets``, divided by ``divisor``, is finite (on every rank when sharded)."""
    finite = all(math.isfinite(grad_norm(opt, b) / divisor) for _group, b in buckets)
    if sharded:  # every rank holding a shard must take the same decision
        finite = mesh_all_true(finite, [b.params[0] for _g, b in buckets if b.params])
    return finite


def run_host(
    opt: KernelOwner,
    plans: list[tuple[dict[str, Any], list[Bucket]]],
    buckets: list[tuple[dict[str, Any], Bucket]],
    plan: UnscalePlan,
    check: bool,
    skips: SkipTracker,
) -> None:
    """One host step over ``buckets`` (the non-empty ones of ``plans``): the finite pre-check (agreed over the
    mesh for DTensor shards), the subclass's ``_pre_step`` (LAMB's clip), one kernel launch per bucket and the
    GradScaler unscale; a skip is reported to ``skips``.

    With several buckets (or DTensor shards) the whole step is skipped on a non-finite grad, so all of them are
    checked first; with one bucket the kernel's own finite check decides before it writes anything.
    """
    divisor = plan.divisor
    pre_checked = False
    sharded = any(b.params and is_dtensor(b.params[0]) for _group, b in buckets)
    if check and (len(buckets) > 1 or sharded):
        if not all_finite(opt, buckets, divisor, sharded):
            skips.skip_on_host()
            return
        pre_checked = True
    if opt._pre_step is not None:
        divisor = opt._pre_step(plans, divisor)
    kernel_unscale = plan.kernel_writes_back(divisor)
    host_kw = {"write_unscaled_grads": True} if kernel_unscale else _NO_KW
    uses_steps = opt._uses_steps
    check_in_kernel = check and not pre_checked
    for group, b in buckets:
        module = _backend.module_for(b.device)
        ctx = opt._ctx(module, b.device)
        if b.on_device:
            if uses_steps:
                b.steps.add_(1)  # the device kernels read the step being taken
            lr, kw = opt._device_loop.lr_for(opt, group, b.device, opt._device_kw(b.device))
            if uses_steps:
                kw["step_ptrs"] = b.step_ptrs
            kw.update(host_kw)
            skipped = opt._launch(module, b, group, Launch(lr, divisor, 0, check_in_kernel, ctx, None, kw))
            if skipped and uses_steps:
                b.steps.sub_(1)
        else:
            launch = Launch(float(group["lr"]), divisor, 0, check_in_kernel, ctx, b.prepare_steps(), host_kw)
            skipped = opt._launch(module, b, group, launch)
            if not skipped and uses_steps:
                b.steps.add_(1)
        if skipped:
            # Only possible on the first (single) bucket: nothing has been written yet.
            skips.skip_on_host()
            return
        b.clear_first_run()
    if plan.unscale_by is not None and not kernel_unscale:
        # the kernels divided by more than the scale (div_scale, LAMB's clip): unscale in a second pass
        unscale_grads([b for _group, b in buckets], plan.unscale_by)


@torch.no_grad()
def fused_step(opt: KernelOwner, closure: Callable[[], Any] | None, div_scale: float = -1) -> Any:
    """One step: under ``torch.compile`` the traceable operator step (:mod:`.compiled`), else the eager step
    over the cached pointer arrays (the operator path would read every tensor's address each step: the pybind
    path is kept here on purpose): validate, run the closure, plan the grad division, then route the buckets to
    the device loop (all on CUDA: no host sync) or the host loop."""
    if torch.compiler.is_compiling():
        return traced_step(opt, closure, div_scale)
    divisor = div_scale_divisor(opt._owner, div_scale)
    opt._groups.revalidate(opt.param_groups)  # bad input is refused before the closure runs
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    skips = opt._skips
    skips.begin_step()
    amp = vars(opt)  # GradScaler's attributes, set on the optimizer only during its step() call
    plan = plan_unscale(opt, divisor, amp.get("grad_scale"), amp.get("found_inf"))
    if plan.skip:
        skips.skip_on_host()
        return loss
    cache = opt._bucket_cache
    plans = [(group, cache.group_buckets(opt, i, group)) for i, group in enumerate(opt.param_groups)]
    buckets = [(group, b) for group, bs in plans for b in bs if b.numel > 0 or b.params]
    if not buckets:
        return loss
    check = opt.skip_nonfinite if opt.skip_nonfinite is not None else opt.master_weights
    plan.check_divisor(opt._owner)
    if all(b.on_device for _group, b in buckets):
        opt._device_loop.run(opt, buckets, plan.divisor, plan.grad_scale, plan.found_inf, check, skips)
        return loss
    # Host path (CPU buckets, possibly beside CUDA ones in HybridAdam): skip decisions are made on the host.
    if plan.to_host():
        skips.skip_on_host()
        return loss
    run_host(opt, plans, buckets, plan, check, skips)
    return loss
