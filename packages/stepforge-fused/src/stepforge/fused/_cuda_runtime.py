# SPDX-License-Identifier: Apache-2.0
"""CUDA-side helpers of stepforge-fused: is the ``_cuda`` module built, can it run here, and how to call it.

The ``_cuda`` extension links the CUDA runtime statically, so it imports on machines without a GPU or driver;
:func:`cuda_status` then says why it cannot run (``"built for sm_80 (cubin), sm_90 (cubin), sm_90 (PTX); CUDA
runtime 13.0 (static); no CUDA driver/device: cudaErrorInsufficientDriver ..."``). The optimizer classes call
the kernels of the contract in ``csrc/README.md`` with ``ctx=stream_handle(device)``; the helpers below build
the extra arguments the CUDA module accepts (device-side ``lr`` and steps for CUDA-graph capture).
"""

from __future__ import annotations

import functools
import importlib
import math
from collections.abc import Iterable, Sequence
from types import ModuleType
from typing import Any

import torch

__all__ = [
    "CudaUnavailableError",
    "cuda_available",
    "cuda_built",
    "cuda_module",
    "clip_divisor_from_sumsq",
    "cuda_status",
    "device_clip_divisor",
    "device_grad_sumsq",
    "device_step_ptrs",
    "dtype_code",
    "increment_device_steps",
    "require_cuda",
    "rollback_skipped_steps",
    "stream_handle",
]

_BUILD_HINT = (
    "stepforge-fused was built without CUDA; rebuild with STEPFORGE_CUDA=ON and nvcc on PATH "
    "(STEPFORGE_CUDA=ON pip install --no-build-isolation packages/stepforge-fused)"
)

_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


class CudaUnavailableError(RuntimeError):
    """The CUDA kernels cannot run: the module was not built, or there is no usable device here."""


@functools.cache
def _load() -> tuple[ModuleType | None, str]:
    try:
        return importlib.import_module("stepforge.fused._cuda"), ""
    except ImportError as exc:
        return None, f"{_BUILD_HINT} (import failed: {exc})"


def cuda_module() -> ModuleType | None:
    """The ``stepforge.fused._cuda`` extension, or ``None`` when it was not built."""
    return _load()[0]


def cuda_built() -> bool:
    """Whether the ``_cuda`` extension is present (it may still lack a device to run on)."""
    return cuda_module() is not None


def cuda_status() -> str:
    """One line for humans: built architectures and runtime, and the device or why there is none.

    Returns:
        e.g. ``"built for sm_80 (cubin), sm_90 (cubin), sm_90 (PTX); CUDA runtime 13.0 (static); no CUDA
        driver/device: cudaErrorInsufficientDriver (...)"``, or the rebuild hint when the module is missing.
    """
    module, why = _load()
    if module is None:
        return why
    status = str(module.status())
    if not torch.cuda.is_available() and module.available():
        status += f"; but torch {torch.__version__} cannot use CUDA (a CPU-only torch build?)"
    return status


def cuda_available() -> bool:
    """Whether the kernels can run: module built, a device visible to it and to torch."""
    module = cuda_module()
    return module is not None and bool(module.available()) and torch.cuda.is_available()


def require_cuda(owner: str = "stepforge-fused") -> ModuleType:
    """Return the ``_cuda`` module or raise :class:`CudaUnavailableError` naming the reason and the fix.

    Args:
        owner: who needs CUDA (used in the message, e.g. ``"FusedAdam"``).
    """
    module = cuda_module()
    if module is None:
        raise CudaUnavailableError(f"{owner}: {_load()[1]}")
    if not cuda_available():
        raise CudaUnavailableError(f"{owner}: the CUDA kernels cannot run here: {cuda_status()}")
    return module


def dtype_code(dtype: torch.dtype) -> int:
    """Kernel dtype code (0 float32, 1 float16, 2 bfloat16) of ``dtype``; ValueError for anything else."""
    try:
        return _DTYPE_CODES[dtype]
    except KeyError:
        raise ValueError(
            f"unsupported dtype {dtype}: the fused kernels take float32, float16 or bfloat16"
        ) from None


def stream_handle(device: torch.device | int | None = None) -> int:
    """The caller's current CUDA stream on ``device`` as the ``ctx`` integer the kernels take."""
    return int(torch.cuda.current_stream(device).cuda_stream)


def device_step_ptrs(steps: Sequence[torch.Tensor]) -> list[int]:
    """Addresses of per-parameter float32 step counters on the device (``step_ptrs=`` of adam/lamb).

    Capturable mode keeps ``state["step"]`` as a 0-dim float32 CUDA tensor (torch's layout for
    ``fused=True``/``capturable=True``), so checkpoints stay interchangeable with ``torch.optim``.

    Raises:
        ValueError: a step is not a float32 CUDA tensor.
    """
    out = []
    for i, s in enumerate(steps):
        if not (isinstance(s, torch.Tensor) and s.is_cuda and s.dtype == torch.float32 and s.numel() == 1):
            raise ValueError(
                f"step {i} must be a 0-dim float32 CUDA tensor for device steps, got "
                f"{type(s).__name__}{'' if not isinstance(s, torch.Tensor) else f' {s.dtype} on {s.device}'}"
            )
        out.append(s.data_ptr())
    return out


def increment_device_steps(steps: Sequence[torch.Tensor], found_inf: torch.Tensor | None = None) -> None:
    """``step += 1`` on the device for every counter, or ``+= 1 - found_inf`` so a skipped step does not count.

    No host synchronisation: safe inside CUDA-graph capture. Call it *before* the kernel (the kernels read
    the step to use in this update). When the overflow decision is made by the kernel itself
    (``check_finite=True``), increment without ``found_inf`` and call :func:`rollback_skipped_steps` after.
    """
    if not steps:
        return
    if found_inf is None:
        torch._foreach_add_(list(steps), 1.0)
    else:
        keep = (1.0 - found_inf.to(torch.float32)).reshape(())  # foreach takes a 0-dim tensor scalar
        torch._foreach_add_(list(steps), keep)


def rollback_skipped_steps(steps: Sequence[torch.Tensor], found_inf: torch.Tensor) -> None:
    """``step -= found_inf`` on the device: undo the increment of a step the kernel skipped (inf/NaN grads)."""
    if steps:
        torch._foreach_sub_(list(steps), found_inf.to(torch.float32).reshape(()))


def device_grad_sumsq(
    module: Any,
    grad_buckets: Iterable[tuple[Any, Any, int]],
    *,
    device: torch.device,
    ctx: int | None = None,
    index: int = -1,
) -> torch.Tensor:
    """``sum g^2`` over every listed grad, accumulated on ``device`` by ``l2norm(sumsq_out_ptr=)`` (no sync).

    Args:
        module: the ``_cuda`` module. grad_buckets: ``(grad pointer array, sizes, grad dtype code)`` per bucket.
        device: the CUDA device of the buckets. ctx: stream handle (default: the current stream of ``device``).
        index: the ``device=`` keyword of the launch (``-1``: from the first pointer).

    Returns:
        a ``(1,)`` float32 tensor on ``device``.
    """
    if ctx is None:
        ctx = stream_handle(device)
    sumsq = torch.zeros(1, device=device, dtype=torch.float32)
    for ptrs, sizes, code in grad_buckets:
        module.l2norm(ptrs, sizes, code, 0, ctx, sumsq_out_ptr=sumsq.data_ptr(), device=index)
    return sumsq


def clip_divisor_from_sumsq(
    sumsq: torch.Tensor, *, divisor: float | torch.Tensor = 1.0, max_norm: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip divisor and overflow flag from a device ``sum g^2`` (see :func:`device_clip_divisor`).

    Args:
        sumsq: ``(1,)`` float32, the sum of squares of the raw grads.
        divisor: what the grads are divided by before the norm (a float, or a 1-element tensor on the same
            device, e.g. GradScaler's scale).
        max_norm: clip threshold; ``<= 0`` (or inf) disables clipping.

    Returns:
        ``(div, found_inf)``: ``div = divisor * max(1, ||g/divisor|| / max_norm)`` and ``found_inf = 1.0`` if the
        norm is inf/NaN else ``0.0``; ``(1,)`` float32 tensors on ``sumsq``'s device.
    """
    norm = sumsq.sqrt() / divisor
    finite = torch.isfinite(norm)
    found_inf = (~finite).to(torch.float32)
    div = torch.ones_like(norm) * divisor
    if max_norm > 0 and math.isfinite(max_norm):
        # NaN/inf norms leave the divisor alone: the step is skipped through found_inf, or they propagate.
        clip = torch.where(finite, torch.clamp(norm / max_norm, min=1.0), torch.ones_like(norm))
        div = div * clip
    return div, found_inf


def device_clip_divisor(
    module: Any,
    grad_buckets: Iterable[tuple[Any, Any, int]],
    *,
    device: torch.device,
    divisor: float | torch.Tensor = 1.0,
    max_norm: float = 0.0,
    ctx: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global grad norm, clip divisor and overflow flag computed on the device, with no host synchronisation.

    The sync-free form of LAMB's ``_pre_step`` and of the multi-bucket finite check: one ``l2norm`` per
    bucket accumulates ``sum g^2`` into one device float (``sumsq_out_ptr``), then torch ops on the device give

    - ``div = divisor * max(1, ||g / divisor|| / max_norm)`` (``max_norm <= 0``: ``div = divisor``), to pass as
      ``grad_divisor_ptr=div.data_ptr()`` together with ``grad_divisor=1.0``;
    - ``found_inf = 1.0`` if the norm is inf/NaN, else ``0.0``, to pass as ``found_inf_ptr`` to every bucket's
      launch, so the whole step is skipped on the device when any grad overflowed.

    Args:
        module: the ``_cuda`` module.
        grad_buckets: ``(grad pointer array, sizes, grad dtype code)`` per bucket.
        device: the CUDA device of the buckets.
        divisor: the grad divisor (loss scale, ``div_scale``; a float or a 1-element tensor on ``device``),
            applied before the norm.
        max_norm: clip threshold; ``<= 0`` disables clipping.
        ctx: stream handle (default: the current stream of ``device``).

    Returns:
        ``(div, found_inf)``: two 1-element float32 tensors on ``device``.
    """
    sumsq = device_grad_sumsq(module, grad_buckets, device=device, ctx=ctx)
    return clip_divisor_from_sumsq(sumsq, divisor=divisor, max_norm=max_norm)
