# SPDX-License-Identifier: Apache-2.0
"""The ``stepforge_fused`` operators other than LAMB's (``adam_``, ``sgd_``, ``l2norm``, ``scale_``): checks,
then one kernel call through :mod:`._op_kernels`. Registered by :mod:`._ops`, which also documents them."""

from __future__ import annotations

from typing import Any

import torch

from . import _op_kernels as k
from ._op_checks import check_flag, check_list, check_scalar_tensor, check_update, one_device

__all__ = [
    "adam_",
    "adam_checks",
    "l2norm",
    "l2norm_checks",
    "pointer_lists",
    "scale_",
    "scale_checks",
    "sgd_",
    "sgd_checks",
]

Tensor = torch.Tensor


def pointer_lists(*lists: list[Tensor], sizes_of: list[Tensor]) -> list[Any]:
    """Pointer lists in kernel order (an empty list as None: no masters) and the sizes."""
    return [k.ptrs(t) if t else None for t in lists] + [k.sizes(sizes_of)]


def scalar_checks(
    op: str, device: Any, lr_tensor: Tensor | None, divisor: Tensor | None, flag: Tensor | None
) -> None:
    """The optional one-element tensors of an update."""
    check_scalar_tensor(op, "lr_tensor", lr_tensor, device)
    check_scalar_tensor(op, "grad_divisor_tensor", divisor, device)
    check_flag(op, flag, device)


# ---- adam_ ----------------------------------------------------------------------------------------------------
def adam_checks(
    *,
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    masters: list[Tensor],
    steps: Tensor,
    lr_tensor: Tensor | None,
    grad_divisor_tensor: Tensor | None,
    found_inf: Tensor | None,
    **_: Any,
) -> tuple[Any, Any, Any]:
    """The argument checks of :func:`adam_` (its fake implementation runs them too); the other arguments are
    accepted and ignored, so the checks take the operator's arguments by name."""
    states = {"exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}
    device, pdt, gdt = check_update("adam_", params, grads, states, masters, steps)
    scalar_checks("adam_", device, lr_tensor, grad_divisor_tensor, found_inf)
    return device, pdt, gdt


def adam_(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    masters: list[Tensor],
    steps: Tensor,
    lr: float,
    lr_tensor: Tensor | None,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw_mode: bool,
    bias_correction: bool,
    grad_divisor: float,
    grad_divisor_tensor: Tensor | None,
    found_inf: Tensor | None,
    check_finite: bool,
    stochastic_rounding: bool,
    seed: int,
) -> None:
    """Adam/AdamW on one (device, param dtype, grad dtype) list (torch's fused operation order); with
    ``masters`` (float32, for float16/bfloat16 params) the masters are updated and the params get the rounded
    copy, stochastically rounded on CUDA with ``stochastic_rounding`` (``seed``: vary it per step)."""
    hyper = [beta1, beta2, eps, weight_decay, adamw_mode, bias_correction]
    device, pdt, gdt = adam_checks(
        params=params, grads=grads, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs, masters=masters, steps=steps,
        lr_tensor=lr_tensor, grad_divisor_tensor=grad_divisor_tensor, found_inf=found_inf,
    )  # fmt: skip
    if device is None:
        return
    lists = pointer_lists(params, grads, exp_avgs, exp_avg_sqs, masters, sizes_of=params)
    common = (grad_divisor, grad_divisor_tensor, found_inf, check_finite, stochastic_rounding)
    kw: dict[str, Any] = {}
    if device.type == "cpu":
        skipped = k.launch_cpu(
            "adam_", "adam", lists, (pdt, gdt), lr, lr_tensor, hyper, *common, steps=steps, **kw
        )
        k.finish_steps_cpu(steps, skipped)
    else:
        result = k.launch_cuda(
            "adam_", "adam", lists, (pdt, gdt), device, lr, lr_tensor, hyper, *common, seed, steps=steps, **kw
        )
        k.finish_steps_cuda(steps, found_inf, result)


# ---- sgd_ -----------------------------------------------------------------------------------------------------
def sgd_checks(
    *,
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Tensor],
    masters: list[Tensor],
    first_run: Tensor | None,
    lr_tensor: Tensor | None,
    momentum: float,
    grad_divisor_tensor: Tensor | None,
    found_inf: Tensor | None,
    **_: Any,
) -> tuple[Any, Any, Any]:
    """The argument checks of :func:`sgd_` (by name, as :func:`adam_checks`)."""
    bufs = {"momentum_buffers": momentum_buffers} if momentum_buffers else {}
    device, pdt, gdt = check_update("sgd_", params, grads, bufs, masters, None)
    if params and (momentum != 0) != bool(momentum_buffers):
        raise ValueError(
            "stepforge_fused::sgd_: momentum_buffers must hold one float32 buffer per parameter when momentum != 0 "
            f"and be empty when momentum == 0 (momentum={momentum}, {len(momentum_buffers)} buffers)."
        )
    if first_run is not None and (first_run.device.type != "cpu" or first_run.numel() != len(params)):
        raise ValueError(
            "stepforge_fused::sgd_: first_run must be a CPU tensor with one flag per parameter "
            f"({len(params)}), got {first_run.numel()} on {first_run.device}."
        )
    scalar_checks("sgd_", device, lr_tensor, grad_divisor_tensor, found_inf)
    return device, pdt, gdt


def sgd_(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Tensor],
    masters: list[Tensor],
    first_run: Tensor | None,
    lr: float,
    lr_tensor: Tensor | None,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    wd_after_momentum: bool,
    grad_divisor: float,
    grad_divisor_tensor: Tensor | None,
    found_inf: Tensor | None,
    check_finite: bool,
    stochastic_rounding: bool,
    seed: int,
) -> None:
    """SGD (torch.optim.SGD semantics, apex's ``wd_after_momentum``). ``momentum_buffers`` is empty iff
    ``momentum == 0``; ``first_run`` (a CPU integer/bool tensor, one flag per parameter; None: all zero) marks
    the buffers initialised with the gradient on this step, and is cleared unless the step was skipped."""
    hyper = [momentum, dampening, weight_decay, nesterov, wd_after_momentum]
    device, pdt, gdt = sgd_checks(
        params=params, grads=grads, momentum_buffers=momentum_buffers, masters=masters, first_run=first_run,
        lr_tensor=lr_tensor, momentum=momentum, grad_divisor_tensor=grad_divisor_tensor, found_inf=found_inf,
    )  # fmt: skip
    if device is None:
        return
    flags = first_run.to(torch.int64).tolist() if first_run is not None else None
    lists = [*pointer_lists(params, grads, momentum_buffers, masters, sizes_of=params), flags]
    common = (grad_divisor, grad_divisor_tensor, found_inf, check_finite, stochastic_rounding)
    kw: dict[str, Any] = {}
    if device.type == "cpu":
        skipped = k.launch_cpu(
            "sgd_", "sgd", lists, (pdt, gdt), lr, lr_tensor, hyper, *common, steps=None, **kw
        )
    else:
        k.launch_cuda(
            "sgd_", "sgd", lists, (pdt, gdt), device, lr, lr_tensor, hyper, *common, seed, steps=None, **kw
        )
        skipped = (
            False  # decided on the device: the host flags are cleared either way, as the eager CUDA step does
        )
    if first_run is not None and not skipped:
        first_run.zero_()


# ---- l2norm ---------------------------------------------------------------------------------------------------
def l2norm_checks(*, tensors: list[Tensor], **_: Any) -> tuple[Any, Any]:
    """The argument checks of :func:`l2norm`."""
    device = one_device("l2norm", {"tensors": tensors})
    dtype = check_list("l2norm", "tensors", tensors, len(tensors))
    return device, dtype


def l2norm(tensors: list[Tensor], per_tensor: bool) -> tuple[Tensor, Tensor]:
    """The global L2 norm of ``tensors`` (one device, one dtype) as a 0-dim tensor on their device -- float64 on
    the CPU (the kernel accumulates in double), float32 on CUDA (the root of the device sum of squares, no sync)
    -- and, with ``per_tensor``, each tensor's norm (float32, ``(n,)``; else ``(0,)``). Non-finite values
    propagate. An empty list gives 0 on the CPU."""
    device, dtype = l2norm_checks(tensors=tensors)
    if device is None or dtype is None:
        return torch.zeros((), dtype=torch.float64), torch.zeros(0, dtype=torch.float32)
    if device.type == "cpu":
        return k.l2norm_cpu(tensors, dtype, per_tensor)
    return k.l2norm_cuda(tensors, dtype, device, per_tensor)


# ---- scale_ ---------------------------------------------------------------------------------------------------
def scale_checks(
    *, src: list[Tensor], dst: list[Tensor], found_inf: Tensor | None, **_: Any
) -> tuple[Any, Any, Any]:
    """The argument checks of :func:`scale_`."""
    device = one_device("scale_", {"src": src, "dst": dst})
    src_dtype = check_list("scale_", "src", src, len(src))
    dst_dtype = check_list("scale_", "dst", dst, len(src), like=src)
    check_flag("scale_", found_inf, device)
    return device, src_dtype, dst_dtype


def scale_(src: list[Tensor], dst: list[Tensor], scale: float, found_inf: Tensor | None) -> None:
    """``dst = src * scale`` (dtype converted; ``dst`` may be ``src``); a non-finite input sets ``found_inf`` to
    1 (everything is still written: apex's ``multi_tensor_scale``)."""
    device, sdt, ddt = scale_checks(src=src, dst=dst, found_inf=found_inf)
    if device is None:
        return
    if device.type == "cpu":
        k.scale_cpu(src, dst, (sdt, ddt), scale, found_inf)
    else:
        k.scale_cuda(src, dst, (sdt, ddt), device, scale, found_inf)
