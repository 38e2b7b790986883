# SPDX-License-Identifier: Apache-2.0
"""stepforge-fused's raw CUDA kernel steps for ``bench_fused_gpu.py``: pointer arrays built once, as an
arena-backed optimizer does, so only the kernel launch is timed.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from bench.gpu._cases import HP, LAMB_HP, Bundle

__all__ = ["kernel_adam", "kernel_lamb", "kernel_sgd"]


def _ptrs(ts: list[torch.Tensor]) -> list[int]:
    return [t.data_ptr() for t in ts]


def kernel_adam(b: Bundle, *, masters: bool) -> Callable[[], None]:
    """Raw ``_cuda.adam`` with pointer arrays built once (what an arena-backed optimizer does every step)."""
    from stepforge.fused import _backend as _cuda_runtime
    from stepforge.testing.fused_cuda import stream_handle

    mod = _cuda_runtime.cuda_module()
    ps = [p.detach() for p in b.params]
    master = [p.float() for p in ps] if masters else None
    ref = master if masters else ps
    m = [torch.zeros_like(t, dtype=torch.float32) for t in ref]
    v = [torch.zeros_like(t, dtype=torch.float32) for t in ref]
    code = _cuda_runtime.dtype_code(ps[0].dtype, what="bench tensors", owner="bench")
    args = (
        _ptrs(ps),
        _ptrs([p.grad for p in b.params]),
        _ptrs(m),
        _ptrs(v),
        None if master is None else _ptrs(master),
        [t.numel() for t in ps],
    )
    state = {"step": 0}
    keep = (m, v, master)

    def step() -> None:
        state["step"] += 1
        mod.adam(
            *args,
            [state["step"]] * len(ps),
            code,
            code,
            HP["lr"],
            0.9,
            0.999,
            HP["eps"],
            HP["weight_decay"],
            True,
            True,
            1.0,
            0,
            False,
            stream_handle(),
        )
        _ = keep

    return step


def kernel_sgd(b: Bundle) -> Callable[[], None]:
    from stepforge.fused import _backend as _cuda_runtime
    from stepforge.testing.fused_cuda import stream_handle

    mod = _cuda_runtime.cuda_module()
    ps = [p.detach() for p in b.params]
    bufs = [torch.zeros_like(p) for p in ps]
    args = (_ptrs(ps), _ptrs([p.grad for p in b.params]), _ptrs(bufs), None, [t.numel() for t in ps])
    first = {"flags": [1] * len(ps)}

    def step() -> None:
        mod.sgd(
            *args,
            first["flags"],
            0,
            0,
            HP["lr"],
            0.9,
            0.0,
            0.0,
            False,
            False,
            1.0,
            0,
            False,
            stream_handle(),
        )
        first["flags"] = [0] * len(ps)
        _ = bufs

    return step


def kernel_lamb(b: Bundle) -> Callable[[], None]:
    """``_cuda.l2norm`` (global grad norm on the device) + the clip factor + ``_cuda.lamb``, no host sync."""
    from stepforge.fused import _backend as _cuda_runtime
    from stepforge.testing.fused_cuda import stream_handle

    mod = _cuda_runtime.cuda_module()
    ps = [p.detach() for p in b.params]
    grads = [p.grad for p in b.params]
    m = [torch.zeros_like(p) for p in ps]
    v = [torch.zeros_like(p) for p in ps]
    sizes = [t.numel() for t in ps]
    sumsq = torch.zeros(1, device="cuda")
    div = torch.ones(1, device="cuda")
    state = {"step": 0}
    gp = _ptrs(grads)
    args = (_ptrs(ps), gp, _ptrs(m), _ptrs(v), None, sizes)

    def step() -> None:
        state["step"] += 1
        ctx = stream_handle()
        sumsq.zero_()
        mod.l2norm(gp, sizes, 0, 0, ctx, sumsq_out_ptr=sumsq.data_ptr())
        torch.clamp(sumsq.sqrt() / LAMB_HP["max_grad_norm"], min=1.0, out=div)
        mod.lamb(
            *args,
            [state["step"]] * len(ps),
            0,
            0,
            LAMB_HP["lr"],
            0.9,
            0.999,
            LAMB_HP["eps"],
            LAMB_HP["weight_decay"],
            True,
            True,
            True,
            False,
            0.0,
            math.inf,
            1.0,
            0,
            False,
            ctx,
            grad_divisor_ptr=div.data_ptr(),
        )
        _ = (m, v)

    return step
