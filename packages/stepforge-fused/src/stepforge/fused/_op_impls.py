# SPDX-License-Identifier: Apache-2.0
"""The ``stepforge_fused`` operators other than LAMB's (``adam_``, ``sgd_``, ``l2norm``, ``scale_``): checks,
then one kernel call through :mod:`._op_kernels`. Registered by :mod:`._ops`, which also documents them.

Each operator's checks come in two parts: those of its tensor lists, run through the layout cache
(:func:`._op_layouts.layout_of`: a layout accepted before is not checked again), and those of its other arguments
(steps, one-element tensors, flags), run at every call. ``<op>_checks`` runs both on the arguments as given: the
fake implementations call it while ``torch.compile`` traces.
"""

from __future__ import annotations

from typing import Any

import torch

from . import _op_kernels as k
from ._op_checks import check_flag, check_list, check_scalar_tensor, check_steps, check_update, one_device
from ._op_layouts import Layout, layout_of

__all__ = [
    "adam_",
    "adam_checks",
    "l2norm",
    "l2norm_checks",
    "scalar_checks",
    "scale_",
    "scale_checks",
    "sgd_",
    "sgd_checks",
    "update_layout",
]

Tensor = torch.Tensor


def update_layout(
    op: str,
    params: list[Tensor],
    grads: list[Tensor] | None,
    states: dict[str, list[Tensor]],
    masters: list[Tensor],
) -> Layout:
    """The checked layout of an update's lists, in kernel order: params, grads (``None``: the op takes none),
    the state lists, masters. Its verdict is ``(device, param dtype, grad dtype)``."""
    lists = [params, *([grads] if grads is not None else []), *states.values(), masters]
    return layout_of(op, lists, lambda: check_update(op, params, grads, states, masters, None))


def scalar_checks(
    op: str, device: Any, lr_tensor: Tensor | None, divisor: Tensor | None, flag: Tensor | None
) -> None:
    """The optional one-element tensors of an update."""
    check_scalar_tensor(op, "lr_tensor", lr_tensor, device)
    check_scalar_tensor(op, "grad_divisor_tensor", divisor, device)
    check_flag(op, flag, device)


# ---- adam_ ----------------------------------------------------------------------------------------------------
def _adam_args(
    device: Any, n: int, steps: Tensor, lr_tensor: Tensor | None, divisor: Tensor | None, flag: Tensor | None
) -> None:
    check_steps("adam_", steps, n, device)
    scalar_checks("adam_", device, lr_tensor, divisor, flag)


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
    """The argument checks of :func:`adam_` (its fake implementation runs them); the other arguments are
    accepted and ignored, so the checks take the operator's arguments by name."""
    states = {"exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}
    device, pdt, gdt = check_update("adam_", params, grads, states, masters, None)
    _adam_args(device, len(params), steps, lr_tensor, grad_divisor_tensor, found_inf)
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
    states = {"exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}
    layout = update_layout("adam_", params, grads, states, masters)
    device, pdt, gdt = layout.verdict
    _adam_args(device, len(params), steps, lr_tensor, grad_divisor_tensor, found_inf)
    if device is None:
        return
    hyper = [beta1, beta2, eps, weight_decay, adamw_mode, bias_correction]
    lists = [*layout.ptrs, layout.sizes]
    common = (grad_divisor, grad_divisor_tensor, found_inf, check_finite, stochastic_rounding)
    if device.type == "cpu":
        skipped = k.launch_cpu("adam_", "adam", lists, (pdt, gdt), lr, lr_tensor, hyper, *common, steps=steps)
        k.finish_steps_cpu(steps, skipped)
    else:
        result = k.launch_cuda(
            "adam_", "adam", lists, (pdt, gdt), device, lr, lr_tensor, hyper, *common, seed, steps=steps
        )
        k.finish_steps_cuda(steps, found_inf, result)


# ---- sgd_ -----------------------------------------------------------------------------------------------------
def _sgd_layout(
    params: list[Tensor], grads: list[Tensor], momentum_buffers: list[Tensor], masters: list[Tensor]
) -> Layout:
    bufs = {"momentum_buffers": momentum_buffers} if momentum_buffers else {}
    lists = [params, grads, momentum_buffers, masters]
    return layout_of("sgd_", lists, lambda: check_update("sgd_", params, grads, bufs, masters, None))


def _sgd_args(
    device: Any,
    n: int,
    momentum: float,
    buffers: int,
    first_run: Tensor | None,
    lr_tensor: Tensor | None,
    divisor: Tensor | None,
    flag: Tensor | None,
) -> None:
    if n and (momentum != 0) != bool(buffers):
        raise ValueError(
            "stepforge_fused::sgd_: momentum_buffers must hold one float32 buffer per parameter when momentum != 0 "
            f"and be empty when momentum == 0 (momentum={momentum}, {buffers} buffers)."
        )
    if first_run is not None and (first_run.device.type != "cpu" or first_run.numel() != n):
        raise ValueError(
            "stepforge_fused::sgd_: first_run must be a CPU tensor with one flag per parameter "
            f"({n}), got {first_run.numel()} on {first_run.device}."
        )
    scalar_checks("sgd_", device, lr_tensor, divisor, flag)


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
    _sgd_args(
        device,
        len(params),
        momentum,
        len(momentum_buffers),
        first_run,
        lr_tensor,
        grad_divisor_tensor,
        found_inf,
    )
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
    layout = _sgd_layout(params, grads, momentum_buffers, masters)
    device, pdt, gdt = layout.verdict
    _sgd_args(
        device,
        len(params),
        momentum,
        len(momentum_buffers),
        first_run,
        lr_tensor,
        grad_divisor_tensor,
        found_inf,
    )
    if device is None:
        return
    hyper = [momentum, dampening, weight_decay, nesterov, wd_after_momentum]
    flags = first_run.to(torch.int64).tolist() if first_run is not None else None
    lists = [*layout.ptrs, layout.sizes, flags]
    common = (grad_divisor, grad_divisor_tensor, found_inf, check_finite, stochastic_rounding)
    if device.type == "cpu":
        skipped = k.launch_cpu("sgd_", "sgd", lists, (pdt, gdt), lr, lr_tensor, hyper, *common, steps=None)
    else:
        k.launch_cuda(
            "sgd_", "sgd", lists, (pdt, gdt), device, lr, lr_tensor, hyper, *common, seed, steps=None
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
    layout = layout_of("l2norm", [tensors], lambda: l2norm_checks(tensors=tensors))
    device, dtype = layout.verdict
    if device is None or dtype is None:
        return torch.zeros((), dtype=torch.float64), torch.zeros(0, dtype=torch.float32)
    n = len(tensors) if per_tensor else 0
    if device.type == "cpu":
        return k.l2norm_cpu(layout.ptrs[0], layout.sizes, dtype, n)
    return k.l2norm_cuda(layout.ptrs[0], layout.sizes, dtype, device, n)


# ---- scale_ ---------------------------------------------------------------------------------------------------
def _scale_lists(src: list[Tensor], dst: list[Tensor]) -> tuple[Any, Any, Any]:
    device = one_device("scale_", {"src": src, "dst": dst})
    src_dtype = check_list("scale_", "src", src, len(src))
    dst_dtype = check_list("scale_", "dst", dst, len(src), like=src)
    return device, src_dtype, dst_dtype


def scale_checks(
    *, src: list[Tensor], dst: list[Tensor], found_inf: Tensor | None, **_: Any
) -> tuple[Any, Any, Any]:
    """The argument checks of :func:`scale_`."""
    device, src_dtype, dst_dtype = _scale_lists(src, dst)
    check_flag("scale_", found_inf, device)
    return device, src_dtype, dst_dtype


def scale_(src: list[Tensor], dst: list[Tensor], scale: float, found_inf: Tensor | None) -> None:
    """``dst = src * scale`` (dtype converted; ``dst`` may be ``src``); a non-finite input sets ``found_inf`` to
    1 (everything is still written: apex's ``multi_tensor_scale``)."""
    layout = layout_of("scale_", [src, dst], lambda: _scale_lists(src, dst))
    device, sdt, ddt = layout.verdict
    check_flag("scale_", found_inf, device)
    if device is None:
        return
    src_ptrs, dst_ptrs = layout.ptrs
    if device.type == "cpu":
        k.scale_cpu(src_ptrs, dst_ptrs, layout.sizes, (sdt, ddt), scale, found_inf)
    else:
        k.scale_cuda(src_ptrs, dst_ptrs, layout.sizes, (sdt, ddt), device, scale, found_inf)
