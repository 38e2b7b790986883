# SPDX-License-Identifier: Apache-2.0
"""The ``stepforge_fused`` operators other than LAMB's two phases: the update operators (``adam_``, ``sgd_``,
``lamb_``), each made from its :class:`~._kernels.KernelSpec` by :func:`update_operator`, and ``l2norm``,
``scale_``: checks, then one kernel call through :mod:`._op_kernels`. Registered by :mod:`._ops`, which also
documents them.

Each operator's checks come in two parts: those of its tensor lists, run through the layout cache
(:func:`._op_layouts.layout_of`: a layout accepted before is not checked again), and those of its other arguments
(steps, one-element tensors, flags), run at every call. ``<op>_checks`` runs both on the arguments as given: the
fake implementations call it while ``torch.compile`` traces.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from . import _op_kernels as k
from ._kernels import KernelSpec
from ._op_checks import check_flag, check_list, check_scalar_tensor, check_steps, check_update, one_device
from ._op_layouts import Layout, layout_of

__all__ = [
    "l2norm",
    "l2norm_checks",
    "scalar_checks",
    "scale_",
    "scale_checks",
    "update_checks",
    "update_layout",
    "update_operator",
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


# ---- adam_, sgd_, lamb_ ---------------------------------------------------------------------------------------
def _sgd_buffers(n: int, a: dict[str, Any]) -> None:
    momentum, buffers, first_run = a["momentum"], len(a["momentum_buffers"]), a["first_run"]
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


def _trust_clip(n: int, a: dict[str, Any]) -> None:
    check_trust_clip_order("lamb_", a["trust_clip_min"], a["trust_clip_max"])


def check_trust_clip_order(op: str, low: float, high: float) -> None:
    """LAMB's trust-ratio clamp ``[low, high]`` must not be empty."""
    if low > high:
        raise ValueError(
            f"stepforge_fused::{op}: trust_clip_min={low} > trust_clip_max={high}; pass (0.0, inf) for no clamp."
        )


#: the checks of one update operator beyond the shared ones (``n``: the number of parameters)
_OWN_CHECKS: dict[str, Callable[[int, dict[str, Any]], None]] = {"sgd_": _sgd_buffers, "lamb_": _trust_clip}


def _states(spec: KernelSpec, a: dict[str, Any]) -> dict[str, list[Tensor]]:
    """The state lists to check (SGD's empty buffer list, momentum 0, is not one)."""
    return {name: a[name] for _key, name in spec.states if a[name] or not spec.optional_states}


def _call_checks(spec: KernelSpec, device: Any, a: dict[str, Any]) -> None:
    """The checks of an update's arguments other than its tensor lists (run at every call)."""
    n = len(a["params"])
    if not spec.first_run:
        check_steps(spec.op, a["steps"], n, device)
    scalar_checks(spec.op, device, a["lr_tensor"], a["grad_divisor_tensor"], a["found_inf"])
    own = _OWN_CHECKS.get(spec.op)
    if own is not None:
        own(n, a)


def update_checks(spec: KernelSpec, **a: Any) -> tuple[Any, Any, Any]:
    """Every check of an update operator on its arguments ``a`` (by name); the fake implementation runs them.
    Returns ``(device, param dtype, grad dtype)``."""
    verdict = check_update(spec.op, a["params"], a["grads"], _states(spec, a), a["masters"], None)
    _call_checks(spec, verdict[0], a)
    return verdict


def update_operator(spec: KernelSpec) -> Callable[..., None]:
    """The real implementation of ``spec``'s operator (arguments in :meth:`KernelSpec.arg_names` order): the
    checks (tensor lists through the layout cache), one kernel call, the steps advanced unless the update was
    skipped (SGD: the first-run flags cleared)."""
    names = spec.arg_names()
    n_lists = 3 + len(spec.states)  # params, grads, *states, masters
    hyper = slice(n_lists + 3, n_lists + 3 + len(spec.hyper))  # after per-tensor, lr, lr_tensor
    op, kernel = spec.op, spec.kernel

    def update(*args: Any) -> None:
        a = dict(zip(names, args, strict=True))
        lists = list(args[:n_lists])
        layout = layout_of(
            op, lists, lambda: check_update(op, a["params"], a["grads"], _states(spec, a), a["masters"], None)
        )
        device, pdt, gdt = layout.verdict
        _call_checks(spec, device, a)
        if device is None:
            return
        ptrs = [*layout.ptrs, layout.sizes]
        steps, first_run, found_inf = a.get("steps"), a.get("first_run"), a["found_inf"]
        if spec.first_run:
            ptrs.append(first_run.to(torch.int64).tolist() if first_run is not None else None)
        common = (
            a["grad_divisor"],
            a["grad_divisor_tensor"],
            found_inf,
            a["check_finite"],
            a["stochastic_rounding"],
        )
        if device.type == "cpu":
            skipped = k.launch_cpu(
                op, kernel, ptrs, (pdt, gdt), a["lr"], a["lr_tensor"], list(args[hyper]), *common, steps=steps
            )
            k.finish_steps_cpu(steps, skipped)
        else:
            result = k.launch_cuda(
                op, kernel, ptrs, (pdt, gdt), device, a["lr"], a["lr_tensor"], list(args[hyper]), *common, a["seed"],
                steps=steps,
            )  # fmt: skip
            k.finish_steps_cuda(steps, found_inf, result)
            skipped = False  # decided on the device: SGD's host flags are cleared either way, as the eager step does
        if first_run is not None and not skipped:
            first_run.zero_()

    update.__name__ = op
    update.__qualname__ = op
    update.__doc__ = f"The ``{op}`` operator over the ``{kernel}`` kernel (arguments: {', '.join(names)})."
    update.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in names]
    )
    return update


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
