# SPDX-License-Identifier: Apache-2.0
"""CUDA helpers the fused tests and benchmarks use to call the ``_cuda`` kernels directly (moved out of
``stepforge.fused``, which never needed them): stream handles and device-side step counters."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["device_step_ptrs", "increment_device_steps", "rollback_skipped_steps", "stream_handle"]


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
        return
    # One add_ per counter, not _foreach_add_(steps, tensor): that overload broke CUDA-graph capture on torch
    # 2.11 (cudaErrorStreamCaptureUnsupported on an H200); an elementwise add_ of a 0-dim CUDA tensor is captured.
    keep = (1.0 - found_inf.to(torch.float32)).reshape(())
    for step in steps:
        step.add_(keep)


def rollback_skipped_steps(steps: Sequence[torch.Tensor], found_inf: torch.Tensor) -> None:
    """``step -= found_inf`` on the device: undo the increment of a step the kernel skipped (inf/NaN grads)."""
    skipped = found_inf.to(torch.float32).reshape(())
    for step in steps:  # per counter, for the reason given in increment_device_steps
        step.sub_(skipped)
