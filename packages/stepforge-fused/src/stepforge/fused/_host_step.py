# SPDX-License-Identifier: Apache-2.0
"""The host loop of the fused optimizers: CPU buckets (and, in HybridAdam, CUDA buckets beside them), with skip
decisions taken on the host."""

from __future__ import annotations

import math
from typing import Any

from . import _backend
from ._amp import AmpUnscaler, UnscalePlan
from ._buckets import Bucket, Launch
from ._device_step import DeviceLoop
from ._distributed import is_dtensor, mesh_all_true
from ._protocol import KernelOwner
from ._skips import SkipTracker

__all__ = ["HostLoop"]

_NO_KW: dict[str, Any] = {}


class HostLoop:
    """One host step over a list of buckets: the finite pre-check (agreed over the mesh for DTensor shards),
    the subclass's ``_pre_step`` (LAMB's clip), one kernel launch per bucket and the GradScaler unscale."""

    __slots__ = ()

    def all_finite(
        self, opt: KernelOwner, buckets: list[tuple[dict[str, Any], Bucket]], divisor: float, sharded: bool
    ) -> bool:
        """Whether every grad of ``buckets``, divided by ``divisor``, is finite (on every rank when sharded)."""
        finite = True
        for _group, b in buckets:
            module = _backend.module_for(b.device)
            norm = module.l2norm(
                b.ptrs["grads"],
                b.sizes,
                _backend.DTYPE_CODES[b.grad_dtype],
                0,
                opt._ctx(module, b.device),
                **opt._device_kw(b.device),
            )
            finite = finite and math.isfinite(norm / divisor)
        if sharded:  # every rank holding a shard must take the same decision
            finite = mesh_all_true(finite, [b.params[0] for _g, b in buckets if b.params])
        return finite

    def run(
        self,
        opt: KernelOwner,
        plans: list[tuple[dict[str, Any], list[Bucket]]],
        buckets: list[tuple[dict[str, Any], Bucket]],
        plan: UnscalePlan,
        check: bool,
        skips: SkipTracker,
        device_loop: DeviceLoop,
    ) -> None:
        """Step ``buckets`` (the non-empty ones of ``plans``); a skip is reported to ``skips``.

        With several buckets (or DTensor shards) the whole step is skipped on a non-finite grad, so all of them
        are checked first; with one bucket the kernel's own finite check decides before it writes anything.
        """
        divisor = plan.divisor
        pre_checked = False
        sharded = any(b.params and is_dtensor(b.params[0]) for _group, b in buckets)
        if check and (len(buckets) > 1 or sharded):
            if not self.all_finite(opt, buckets, divisor, sharded):
                skips.skip_on_host()
                return
            pre_checked = True
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
                lr, kw = device_loop.lr_for(opt, group, b.device, opt._device_kw(b.device))
                if uses_steps:
                    kw["step_ptrs"] = b.step_ptrs
                kw.update(host_kw)
                skipped = opt._launch(
                    module, b, group, Launch(lr, divisor, 0, check_in_kernel, ctx, None, kw)
                )
                if skipped and uses_steps:
                    b.steps.sub_(1)
            else:
                launch = Launch(
                    float(group["lr"]), divisor, 0, check_in_kernel, ctx, b.prepare_steps(), host_kw
                )
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
            AmpUnscaler.unscale_grads([b for _group, b in buckets], plan.unscale_by)
