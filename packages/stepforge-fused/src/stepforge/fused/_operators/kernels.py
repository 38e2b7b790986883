# SPDX-License-Identifier: Apache-2.0
"""The CPU and CUDA implementations of the ``stepforge_fused`` operators: the pointer arrays of a checked layout
(:mod:`.layouts`) and the operator's scalars to the pybind11 kernels (``_cpu``/``_cuda``, contract in
``csrc/README.md``), steps advanced unless the step was skipped.

Each function takes the operator's arguments after :mod:`.checks` has accepted them (the callers, in
:mod:`.impls`, check first).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .. import _backend
from .._backend import device_env

__all__ = [
    "host_scalar",
    "launch_cpu",
    "launch_cuda",
    "finish_steps_cpu",
    "finish_steps_cuda",
    "l2norm_cpu",
    "l2norm_cuda",
    "scale_cpu",
    "scale_cuda",
]


def host_scalar(value: float, tensor: torch.Tensor | None) -> float:
    """``tensor``'s value when given (read on the host: CPU steps only), else ``value``."""
    return float(tensor) if tensor is not None else float(value)


def _check_divisor(op: str, divisor: float) -> float:
    if not math.isfinite(divisor) or divisor <= 0:
        raise ValueError(f"stepforge_fused::{op}: grad_divisor must be positive and finite, got {divisor}.")
    return divisor


def _code(dtype: torch.dtype | None) -> int:
    return _backend.DTYPE_CODES[dtype] if dtype is not None else 0


def _host_steps(steps: torch.Tensor) -> list[int]:
    """The step being taken per tensor (``state step + 1``), as the CPU kernels take it."""
    return steps.to(torch.int64).add_(1).tolist()


def launch_cpu(
    op: str,
    spec: _backend.KernelSpec,
    ptrs: list[Any],
    sizes: Any,
    dtypes: tuple[torch.dtype | None, torch.dtype | None],
    lr: float,
    lr_tensor: torch.Tensor | None,
    hyper: list[Any],
    grad_divisor: float,
    grad_divisor_tensor: torch.Tensor | None,
    found_inf: torch.Tensor | None,
    check_finite: bool,
    stochastic_rounding: bool,
    *,
    steps: torch.Tensor | None,
    first_run: list[int] | None = None,
    **kw: Any,
) -> bool:
    """One CPU call of ``spec``'s kernel (:func:`~stepforge.fused._backend.call_kernel`) with the host steps
    (``step + 1``) or SGD's ``first_run`` flags; returns whether the kernel skipped the update (a raised
    ``found_inf`` or its finite check)."""
    if stochastic_rounding:
        raise ValueError(
            f"stepforge_fused::{op}: stochastic rounding is done by the CUDA kernels only; the CPU kernels round "
            "to nearest even. Pass stochastic_rounding=False for CPU tensors."
        )
    # the divisor tensor multiplies the float, as the CUDA kernels do with grad_divisor_ptr
    divisor = grad_divisor if grad_divisor_tensor is None else grad_divisor * float(grad_divisor_tensor)
    per_tensor = first_run if spec.first_run else _host_steps(steps) if steps is not None else None
    skipped = _backend.call_kernel(
        _backend.cpu_module(), spec, ptrs, sizes, per_tensor, (_code(dtypes[0]), _code(dtypes[1])),
        host_scalar(lr, lr_tensor), hyper, _check_divisor(op, divisor), _flag(found_inf), check_finite,
        _backend.get_num_threads(), **kw,
    )  # fmt: skip
    return bool(skipped)


def _flag(found_inf: torch.Tensor | None) -> int:
    return found_inf.data_ptr() if found_inf is not None else 0


def finish_steps_cpu(steps: torch.Tensor | None, skipped: bool) -> None:
    """Advance the step counters of an update that was not skipped (the kernels never do)."""
    if steps is not None and not skipped:
        steps.add_(1.0)


def _device_scalar(t: torch.Tensor, device: torch.device, keep: list[torch.Tensor]) -> int:
    """Address of ``t`` as a float32 element on ``device`` (a converted copy is kept alive in ``keep``)."""
    if t.device != device or t.dtype != torch.float32 or not t.is_contiguous():
        t = t.to(device=device, dtype=torch.float32).contiguous()
        keep.append(t)
    return t.data_ptr()


def launch_cuda(
    op: str,
    spec: _backend.KernelSpec,
    ptrs: list[Any],
    sizes: Any,
    dtypes: tuple[torch.dtype | None, torch.dtype | None],
    device: torch.device,
    lr: float,
    lr_tensor: torch.Tensor | None,
    hyper: list[Any],
    grad_divisor: float,
    grad_divisor_tensor: torch.Tensor | None,
    found_inf: torch.Tensor | None,
    check_finite: bool,
    stochastic_rounding: bool,
    seed: int,
    *,
    steps: torch.Tensor | None,
    first_run: list[int] | None = None,
    **kw: Any,
) -> Any:
    """One CUDA call of ``spec``'s kernel (:func:`~stepforge.fused._backend.call_kernel`) on the caller's current stream, never synchronising when ``found_inf`` is given: lr
    and the divisor tensor are read by the kernel on the device, steps through their addresses (advanced before
    the launch; :func:`finish_steps_cuda` takes a skipped step back). Returns the kernel's result (``None``: the
    decision is on the device)."""
    module = _backend.cuda_module()
    ctx, index = device_env(device)
    keep: list[torch.Tensor] = []
    host_lr = float(lr)
    if lr_tensor is not None:
        if lr_tensor.device.type == "cpu":
            host_lr = float(lr_tensor)
        else:
            kw["lr_ptr"] = _device_scalar(lr_tensor, device, keep)
            host_lr = 0.0
    if grad_divisor_tensor is not None:
        kw["grad_divisor_ptr"] = _device_scalar(grad_divisor_tensor, device, keep)
    if steps is not None:  # device steps: read through step_ptrs
        steps.add_(1.0)
        first = steps.data_ptr()
        kw["step_ptrs"] = list(range(first, first + 4 * steps.numel(), 4))
    return _backend.call_kernel(
        module, spec, ptrs, sizes, first_run if spec.first_run else None, (_code(dtypes[0]), _code(dtypes[1])),
        host_lr, hyper, _check_divisor(op, grad_divisor), _flag(found_inf), check_finite, ctx,
        stochastic_rounding=stochastic_rounding, seed=seed, device=index, **kw,
    )  # fmt: skip


def finish_steps_cuda(steps: torch.Tensor | None, found_inf: torch.Tensor | None, result: Any) -> None:
    """Take back the step of a CUDA update that was skipped: by the device flag (no sync), or by the kernel's
    host answer when no flag was given."""
    if steps is None:
        return
    if found_inf is not None:
        steps.sub_(found_inf.ne(0).to(torch.float32))
    elif result:
        steps.sub_(1.0)


def l2norm_cpu(
    ptrs: Any, sizes: Any, dtype: torch.dtype, per_tensor: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global norm (0-dim float64: the kernel accumulates in double) and the per-tensor norms of the first
    ``per_tensor`` tensors (float32; 0: none) of the tensors at ``ptrs`` (``sizes`` elements each)."""
    each = torch.zeros(per_tensor, dtype=torch.float32)
    norm = _backend.cpu_module().l2norm(
        ptrs, sizes, _code(dtype), each.data_ptr() if per_tensor else 0, _backend.get_num_threads()
    )
    return torch.tensor(norm, dtype=torch.float64), each


def l2norm_cuda(
    ptrs: Any, sizes: Any, dtype: torch.dtype, device: torch.device, per_tensor: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global norm (0-dim float32, the square root of the device sum of squares: no sync) and per-tensor norms."""
    ctx, index = device_env(device)
    each = torch.zeros(per_tensor, dtype=torch.float32, device=device)
    sumsq = torch.zeros(1, dtype=torch.float32, device=device)
    _backend.cuda_module().l2norm(
        ptrs,
        sizes,
        _code(dtype),
        each.data_ptr() if per_tensor else 0,
        ctx,
        sumsq_out_ptr=sumsq.data_ptr(),
        device=index,
    )
    return sumsq.sqrt().reshape(()), each


def scale_cpu(
    src: Any,
    dst: Any,
    sizes: Any,
    dtypes: tuple[torch.dtype | None, torch.dtype | None],
    scale: float,
    found_inf: torch.Tensor | None,
) -> None:
    """``dst = src * scale`` with dtype conversion (pointer arrays); a non-finite input raises ``found_inf``."""
    _backend.cpu_module().scale(
        src,
        dst,
        sizes,
        _code(dtypes[0]),
        _code(dtypes[1]),
        scale,
        _flag(found_inf),
        _backend.get_num_threads(),
    )


def scale_cuda(
    src: Any,
    dst: Any,
    sizes: Any,
    dtypes: tuple[torch.dtype | None, torch.dtype | None],
    device: torch.device,
    scale: float,
    found_inf: torch.Tensor | None,
) -> None:
    """The CUDA ``scale`` on the current stream (no sync)."""
    ctx, index = device_env(device)
    _backend.cuda_module().scale(
        src,
        dst,
        sizes,
        _code(dtypes[0]),
        _code(dtypes[1]),
        scale,
        _flag(found_inf),
        ctx,
        device=index,
    )
