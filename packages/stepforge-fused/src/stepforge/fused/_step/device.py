# SPDX-License-Identifier: Apache-2.0
"""The CUDA (device) step of the fused optimizers: no host synchronisation, one launch path for every class.

Skip decisions, clip factors, ``lr`` (capturable) and step counters stay on the device; HybridAdam's CUDA
buckets take this path too when every bucket of a step is on a device. :class:`SkipTracker` holds the skips of
every step, decided on the host or on a device.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

import torch

from stepforge.core import HyperParameterError

from .. import _backend
from .buckets import Bucket, Launch

if TYPE_CHECKING:
    from .protocol import KernelOwner

__all__ = ["DeviceLoop", "SkipTracker", "clip_divisor_from_sumsq", "device_grad_sumsq"]


def device_grad_sumsq(
    module: Any,
    grad_buckets: Iterable[tuple[Any, Any, int]],
    *,
    device: torch.device,
    ctx: int,
    index: int = -1,
) -> torch.Tensor:
    """``sum g^2`` over every ``(grad pointer array, sizes, grad dtype code)``, accumulated into a ``(1,)`` float32
    tensor on ``device`` by ``module.l2norm(sumsq_out_ptr=)`` (no sync); ``index``: the launch's ``device=``."""
    sumsq = torch.zeros(1, device=device, dtype=torch.float32)
    for ptrs, sizes, code in grad_buckets:
        module.l2norm(ptrs, sizes, code, 0, ctx, sumsq_out_ptr=sumsq.data_ptr(), device=index)
    return sumsq


def clip_divisor_from_sumsq(
    sumsq: torch.Tensor, *, divisor: float | torch.Tensor = 1.0, max_norm: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(div, found_inf)`` from a ``sum g^2`` of the raw grads: ``div = divisor * max(1, ||g/divisor|| /
    max_norm)`` (``max_norm <= 0`` or inf: no clip; ``divisor`` a float or a one-element tensor, e.g. GradScaler's
    scale) and ``found_inf = 1.0`` if the norm is inf/NaN else ``0.0``, on ``sumsq``'s device."""
    norm = sumsq.sqrt() / divisor
    finite = torch.isfinite(norm)
    found_inf = (~finite).to(torch.float32)
    div = torch.ones_like(norm) * divisor
    if max_norm > 0 and math.isfinite(max_norm):
        # NaN/inf norms leave the divisor alone: the step is skipped through found_inf, or they propagate.
        clip = torch.where(finite, torch.clamp(norm / max_norm, min=1.0), torch.ones_like(norm))
        div = div * clip
    return div, found_inf


class SkipTracker:
    """Skipped steps decided on the host (``host_last``, ``host_count``) and on devices: one persistent float32
    ``(1,)`` flag per device (``flags``, the ``found_inf_ptr`` of its launches; ``last_flags``: those of the last
    step) and a counter of device-decided skips per device (``counts``), never read inside ``step()``."""

    __slots__ = ("counts", "flags", "host_count", "host_last", "last_flags")

    def __init__(self, host_last: bool = False, host_count: int = 0) -> None:
        self.host_last = host_last
        self.host_count = host_count
        self.last_flags: list[torch.Tensor] = []
        self.flags: dict[torch.device, torch.Tensor] = {}
        self.counts: dict[torch.device, torch.Tensor] = {}

    def begin_step(self) -> None:
        """A new step starts: nothing skipped yet."""
        self.host_last = False
        self.last_flags = []

    def skip_on_host(self) -> None:
        """The step was skipped by a host decision."""
        self.host_last = True
        self.host_count += 1

    def last_skipped(self) -> bool:
        """Whether the last step was skipped (reads the device flags: synchronises after a CUDA step)."""
        if self.host_last:
            return True
        return any(bool(f.ne(0).any()) for f in self.last_flags)

    def set_last(self, value: bool) -> None:
        self.host_last = bool(value)
        self.last_flags = []

    def skipped(self) -> int:
        """How many steps were skipped (device counters read on access)."""
        return self.host_count + sum(int(c.sum().item()) for c in self.counts.values())

    def set_skipped(self, value: int) -> None:
        self.host_count = int(value)
        self.counts = {}

    def device_flag(self, device: torch.device, found_inf: torch.Tensor | None) -> torch.Tensor:
        """``device``'s flag, set to GradScaler's ``found_inf`` (on the stream, no sync) or to 0."""
        flag = self.flags.get(device)
        if flag is None:
            flag = self.flags[device] = torch.zeros(1, dtype=torch.float32, device=device)
        if found_inf is not None:
            flag.copy_(found_inf.to(device=device, dtype=torch.float32, non_blocking=True).reshape(1))
        else:
            flag.zero_()
        return flag

    def record_device(self, device: torch.device, flag: torch.Tensor) -> None:
        """The step on ``device`` was decided by ``flag``: remember it and count it (on the device)."""
        self.last_flags.append(flag)
        count = self.counts.get(device)
        if count is None:
            count = self.counts[device] = torch.zeros(1, dtype=torch.float32, device=device)
        count.add_(flag.ne(0).to(torch.float32))


class DeviceLoop:
    """The CUDA step of one optimizer, and the device buffers of its float ``lr`` values (capturable):
    ``lr_bufs``, ``(id(group), device)`` -> ``(value, (1,) float32 device buffer)``."""

    __slots__ = ("lr_bufs",)

    def __init__(self) -> None:
        self.lr_bufs: dict[tuple[int, torch.device], tuple[float, torch.Tensor]] = {}

    def lr_for(
        self, opt: KernelOwner, group: dict[str, Any], device: torch.device, kw: dict[str, Any]
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
                    f"{opt._owner}: a Tensor lr must have one element, got {lr.numel()}"
                )
            if lr.device != device or lr.dtype != torch.float32 or not lr.is_contiguous():
                if group.get("capturable", False) and lr.device.type == "cpu":
                    raise RuntimeError(
                        f"{opt._owner}: with capturable=True a Tensor lr must live on the parameters' device "
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
        cached = self.lr_bufs.get(key)
        if cached is None or cached[0] != value:
            buf = cached[1] if cached is not None else torch.empty(1, dtype=torch.float32, device=device)
            buf.fill_(value)
            self.lr_bufs[key] = (value, buf)
            cached = self.lr_bufs[key]
        kw["lr_ptr"] = cached[1].data_ptr()
        return 0.0, kw

    def run(
        self,
        opt: KernelOwner,
        buckets: list[tuple[dict[str, Any], Bucket]],
        divisor: float,
        grad_scale: torch.Tensor | None,
        found_inf: torch.Tensor | None,
        check: bool,
        skips: SkipTracker,
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
        clip_norm = opt._device_clip_norm()
        need_norm = clip_norm > 0 or (check and len(buckets) > 1)
        env = {device: opt._device_env(device) for device in by_dev}
        sumsq: dict[torch.device, torch.Tensor] = {}
        if need_norm:
            for device, items in by_dev.items():
                ctx, index = env[device]
                sumsq[device] = device_grad_sumsq(
                    _backend.module_for(device),
                    [(b.ptrs["grads"], b.sizes, _backend.DTYPE_CODES[b.grad_dtype]) for _g, b in items],
                    device=device,
                    ctx=ctx,
                    index=index,
                )
            if len(sumsq) > 1:  # one global norm over every device (device-to-device copies, no host sync)
                first = next(iter(sumsq))
                total = cast(torch.Tensor, sum(t.to(first, non_blocking=True) for t in sumsq.values()))
                sumsq = {d: total.to(d, non_blocking=True) for d in sumsq}
        kernel_check = check and not need_norm
        uses_steps = opt._uses_steps
        # GradScaler's grads are left divided by its scale (torch's contract); the kernel writes them back in
        # the same pass when it divides by exactly the scale, otherwise a device-side second pass does it.
        kernel_unscale = grad_scale is not None and clip_norm <= 0 and divisor == 1.0
        for device, items in by_dev.items():
            module = _backend.module_for(device)
            ctx, index = env[device]
            scale = None
            if grad_scale is not None:
                scale = grad_scale.to(device=device, dtype=torch.float32, non_blocking=True).reshape(1)
            flag = skips.device_flag(device, found_inf) if found_inf is not None or check else None
            factor = scale  # multiplies the host divisor inside the kernel (grad_divisor_ptr)
            launch_div = divisor
            if need_norm:
                total_div = divisor if scale is None else scale * divisor
                div, found = clip_divisor_from_sumsq(sumsq[device], divisor=total_div, max_norm=clip_norm)
                if clip_norm > 0:
                    factor, launch_div = div, 1.0  # div = divisor * scale * clip, all on the device
                if check:  # check made the flag (device_flag above)
                    torch.maximum(cast(torch.Tensor, flag), found, out=flag)
            keep = None
            if uses_steps and flag is not None and not kernel_check:
                keep = 1.0 - flag
            for group, b in items:
                lr, kw = self.lr_for(opt, group, device, {"device": index})
                if factor is not None:
                    kw["grad_divisor_ptr"] = factor.data_ptr()
                if kernel_unscale:
                    kw["write_unscaled_grads"] = True
                if uses_steps:
                    kw["step_ptrs"] = b.step_ptrs
                    b.steps.add_(keep if keep is not None else 1)
                launch = Launch(
                    lr, launch_div, 0 if flag is None else flag.data_ptr(), kernel_check, ctx, None, kw
                )
                opt._launch(module, b, group, launch)
                if uses_steps and kernel_check:
                    # the kernel's finite check skipped the update: that step does not count (kernel_check
                    # implies check, so the flag exists)
                    b.steps.sub_(cast(torch.Tensor, flag))
                # SGD's first-run flags are host-side: a skipped first step (device decision) still clears them;
                # with dampening=0 (the default) the first buffer is exact either way (0*momentum + g = g).
                b.clear_first_run()
            if scale is not None and not kernel_unscale:
                # every bucketed parameter has a grad
                grads = [cast(torch.Tensor, p.grad) for _g, b in items for p in b.params]
                if grads:
                    by = scale if flag is None else torch.where(flag != 0, torch.ones_like(scale), scale)
                    torch._foreach_div_(grads, by.reshape(()))
            if flag is not None:
                skips.record_device(device, flag)
