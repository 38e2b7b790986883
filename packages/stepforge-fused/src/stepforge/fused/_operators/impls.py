# SPDX-License-Identifier: Apache-2.0
"""The CPU and CUDA implementations of the ``stepforge_fused`` operators (registered, and documented, by
:mod:`stepforge.fused._operators`): ``adam_``, ``sgd_``, ``lamb_`` made from their
:class:`~stepforge.fused._backend.KernelSpec` by :func:`update_operator`; LAMB's two phases for norms summed
elsewhere first (sharded parameters), ``lamb_moments_`` and ``lamb_apply_``; ``l2norm`` and ``scale_``. The
update kernels are called through :func:`~stepforge.fused._backend.call_kernel` (:func:`_update`).

Each operator's checks come in two parts: those of its tensor lists, run through the layout cache
(:func:`.layouts.layout_of`: a layout accepted before is not checked again), and those of its other arguments
(steps, one-element tensors, flags), run at every call. :func:`checks` runs both on the arguments as given: the
fake implementations call it while ``torch.compile`` traces.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import torch

from .. import _backend
from .._backend import DTYPE_CODES, LAMB, KernelSpec, call_kernel
from .checks import check_flag, check_list, check_scalar_tensor, check_steps, check_update, one_device
from .layouts import Layout, layout_of

__all__ = [
    "LAMB_PHASES",
    "by_name",
    "checks",
    "l2norm",
    "l2norm_checks",
    "lamb_apply_",
    "lamb_moments_",
    "lamb_norms_like",
    "scale_",
    "scale_checks",
    "update",
]

Tensor = torch.Tensor


def _states(spec: KernelSpec, a: dict[str, Any]) -> dict[str, list[Tensor]]:
    """The state lists to check (SGD's empty buffer list, momentum 0, is not one)."""
    return {name: a[name] for _key, name in spec.states if a[name] or not spec.optional_states}


def _list_checks(op: str, spec: KernelSpec, a: dict[str, Any]) -> tuple[Any, Any, Any]:
    return check_update(op, a["params"], a.get("grads"), _states(spec, a), a["masters"])


def _layout(op: str, spec: KernelSpec, a: dict[str, Any]) -> Layout:
    """The checked layout of an update's lists, in kernel order: params, grads (when the op takes them), the
    state lists, masters. Its verdict is ``(device, param dtype, grad dtype)``."""
    lists = [
        a["params"],
        *([a["grads"]] if "grads" in a else []),
        *(a[n] for _k, n in spec.states),
        a["masters"],
    ]
    return layout_of(op, lists, lambda: _list_checks(op, spec, a))


def _arg_checks(op: str, device: torch.device | None, a: dict[str, Any]) -> None:
    """The checks of an update's arguments other than its tensor lists, by name (run at every call)."""
    n = len(a["params"])
    if "steps" in a:
        check_steps(op, a["steps"], n, device)
    check_scalar_tensor(op, "lr_tensor", a.get("lr_tensor"), device)
    check_scalar_tensor(op, "grad_divisor_tensor", a.get("grad_divisor_tensor"), device)
    check_flag(op, a.get("found_inf"), device)
    if "trust_clip_min" in a and a["trust_clip_min"] > a["trust_clip_max"]:
        raise ValueError(
            f"stepforge_fused::{op}: trust_clip_min={a['trust_clip_min']} > trust_clip_max={a['trust_clip_max']}; "
            "pass (0.0, inf) for no clamp."
        )
    norms = a.get("norms")
    if norms is not None and (
        norms.dtype != torch.float64 or norms.numel() != 2 * n or not norms.is_contiguous()
    ):
        raise ValueError(
            f"stepforge_fused::{op}: norms must be the contiguous float64 (2n,) tensor lamb_moments_ returns "
            f"(n = {n}), got shape {tuple(norms.shape)} {norms.dtype}."
        )
    if norms is not None and device is not None and norms.device != device:
        raise RuntimeError(f"stepforge_fused::{op}: norms is on {norms.device}; it must be on {device}.")
    if "momentum_buffers" in a:
        momentum, buffers, first_run = a["momentum"], len(a["momentum_buffers"]), a["first_run"]
        if n and (momentum != 0) != bool(buffers):
            raise ValueError(
                "stepforge_fused::sgd_: momentum_buffers must hold one float32 buffer per parameter when momentum "
                f"!= 0 and be empty when momentum == 0 (momentum={momentum}, {buffers} buffers)."
            )
        if first_run is not None and (first_run.device.type != "cpu" or first_run.numel() != n):
            raise ValueError(
                "stepforge_fused::sgd_: first_run must be a CPU tensor with one flag per parameter "
                f"({n}), got {first_run.numel()} on {first_run.device}."
            )


def checks(op: str, spec: KernelSpec, a: dict[str, Any]) -> tuple[Any, Any, Any]:
    """Every check of the update operator ``op`` (over ``spec``'s kernel) on its arguments ``a`` (by name); the
    fake implementations run them. Returns ``(device, param dtype, grad dtype)``."""
    verdict = _list_checks(op, spec, a)
    _arg_checks(op, verdict[0], a)
    return verdict


def _env(device: torch.device) -> tuple[Any, int, dict[str, Any]]:
    """The kernel module of ``device``, the ``ctx`` of a call (CPU threads / the current CUDA stream) and its
    keywords (the CUDA device index)."""
    if device.type == "cpu":
        return _backend.cpu_module(), _backend.get_num_threads(), {}
    ctx, index = _backend.device_env(device)
    return _backend.cuda_module(), ctx, {"device": index}


def _device_scalar(t: Tensor, device: torch.device, keep: list[Tensor]) -> int:
    """Address of ``t`` as a float32 element on ``device`` (a converted copy is kept alive in ``keep``)."""
    if t.device != device or t.dtype != torch.float32 or not t.is_contiguous():
        t = t.to(device=device, dtype=torch.float32).contiguous()
        keep.append(t)
    return t.data_ptr()


def _check_divisor(op: str, divisor: float) -> float:
    if not math.isfinite(divisor) or divisor <= 0:
        raise ValueError(f"stepforge_fused::{op}: grad_divisor must be positive and finite, got {divisor}.")
    return divisor


def _update(
    op: str,
    spec: KernelSpec,
    layout: Layout,
    a: dict[str, Any],
    hyper: list[Any],
    *,
    first_run: list[int] | None = None,
    advance: bool = True,
    ptrs: list[Any] | None = None,
    **kw: Any,
) -> bool:
    """One call of ``spec``'s kernel on ``layout``'s pointer arrays (``ptrs``: others in their place) with the
    operator's arguments ``a`` (by name; absent: ``lr`` 0, divisor 1, no tensors, no check, no rounding), the
    steps advanced unless skipped (``advance=False``: left alone). CUDA reads lr, divisor and steps on the device,
    never synchronising when ``found_inf`` is given. Returns whether the kernel skipped on the host."""
    device, pdt, gdt = layout.verdict
    module, ctx, env = _env(device)
    ptrs = list(layout.ptrs) if ptrs is None else ptrs
    dtypes = (DTYPE_CODES[pdt], DTYPE_CODES[gdt])
    steps, found_inf, lr_tensor = a.get("steps"), a.get("found_inf"), a.get("lr_tensor")
    divisor, divisor_tensor = a.get("grad_divisor", 1.0), a.get("grad_divisor_tensor")
    flag = found_inf.data_ptr() if found_inf is not None else 0
    check_finite, rounding = a.get("check_finite", False), a.get("stochastic_rounding", False)
    if device.type == "cpu":
        if rounding:
            raise ValueError(
                f"stepforge_fused::{op}: stochastic rounding is done by the CUDA kernels only; the CPU kernels "
                "round to nearest even. Pass stochastic_rounding=False for CPU tensors."
            )
        # the divisor tensor multiplies the float, as the CUDA kernels do with grad_divisor_ptr
        divisor = divisor if divisor_tensor is None else divisor * float(divisor_tensor)
        per_tensor = first_run if spec.first_run else None
        if steps is not None:
            per_tensor = steps.to(torch.int64).add_(1).tolist()  # the step being taken
        host_lr = float(lr_tensor) if lr_tensor is not None else float(a.get("lr", 0.0))
        skipped = call_kernel(
            module, spec, ptrs, layout.sizes, per_tensor, dtypes, host_lr, hyper, _check_divisor(op, divisor), flag,
            check_finite, ctx, **kw,
        )  # fmt: skip
        if advance and steps is not None and not skipped:
            steps.add_(1.0)
        return bool(skipped)
    keep: list[Tensor] = []  # converted device scalars, alive until the launch is enqueued
    host_lr = float(a.get("lr", 0.0))
    if lr_tensor is not None and lr_tensor.device.type == "cpu":
        host_lr = float(lr_tensor)
    elif lr_tensor is not None:
        kw["lr_ptr"], host_lr = _device_scalar(lr_tensor, device, keep), 0.0
    if divisor_tensor is not None:
        kw["grad_divisor_ptr"] = _device_scalar(divisor_tensor, device, keep)
    if steps is not None:  # device steps, read through step_ptrs: advanced now, a skip taken back below
        steps.add_(1.0)
        kw["step_ptrs"] = list(range(steps.data_ptr(), steps.data_ptr() + 4 * steps.numel(), 4))
    result = call_kernel(
        module, spec, ptrs, layout.sizes, first_run if spec.first_run else None, dtypes, host_lr, hyper,
        _check_divisor(op, divisor), flag, check_finite, ctx, stochastic_rounding=rounding, seed=a.get("seed", 0),
        **env, **kw,
    )  # fmt: skip
    if steps is not None and not advance:
        steps.sub_(1.0)
    elif steps is not None and found_inf is not None:
        steps.sub_(found_inf.ne(0).to(torch.float32))  # by the device flag: no sync
    elif steps is not None and result:
        steps.sub_(1.0)
    return False


def by_name(schema: str, body: Callable[[dict[str, Any]], Any]) -> Callable[..., Any]:
    """The implementation of the operator of ``schema``: its arguments, by their schema names, to ``body``."""
    op, _, args = schema.partition("(")
    names = [arg.rsplit(" ", 1)[1] for arg in args.rpartition(") ->")[0].split(", ")]

    def impl(*args: Any) -> Any:
        return body(dict(zip(names, args, strict=True)))

    impl.__name__ = impl.__qualname__ = op
    impl.__doc__ = body.__doc__
    impl.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in names]
    )
    return impl


def update(spec: KernelSpec, a: dict[str, Any]) -> None:
    """The update operators (``spec.op``): the checks (tensor lists through the layout cache), one kernel call,
    the steps advanced unless the update was skipped (SGD: the first-run flags cleared)."""
    op = spec.op
    layout = _layout(op, spec, a)
    _arg_checks(op, layout.verdict[0], a)
    if layout.verdict[0] is None:
        return
    first_run = a.get("first_run")
    flags = first_run.to(torch.int64).tolist() if first_run is not None else None
    skipped = _update(op, spec, layout, a, [a[x.name] for x in spec.hyper], first_run=flags)
    # CUDA decides on the device: SGD's host flags are cleared either way, as the eager step does
    if first_run is not None and not skipped:
        first_run.zero_()


_LAMB_HYPER = ", ".join(f"{x.type} {x.name}" for x in LAMB.hyper[:8])  # the phases take the clamp apart
#: the schemas of LAMB's two phases (``Tensor(x!)`` marks what they write)
LAMB_PHASES = {
    "lamb_moments_": (
        "lamb_moments_(Tensor[] params, Tensor[] grads, Tensor(a!)[] exp_avgs, Tensor(b!)[] exp_avg_sqs, "
        f"Tensor[] masters, Tensor steps, {_LAMB_HYPER}, float grad_divisor, Tensor? grad_divisor_tensor, "
        "Tensor(c!)? found_inf, bool check_finite) -> Tensor"
    ),
    "lamb_apply_": (
        "lamb_apply_(Tensor(a!)[] params, Tensor[] exp_avgs, Tensor[] exp_avg_sqs, Tensor(b!)[] masters, "
        f"Tensor(c!) steps, Tensor norms, float lr, Tensor? lr_tensor, {_LAMB_HYPER}, float trust_clip_min, "
        "float trust_clip_max, Tensor? found_inf, bool stochastic_rounding, int seed) -> ()"
    ),
}


def lamb_norms_like(params: list[Tensor]) -> Tensor:
    """The ``(2n,)`` float64 buffer of the per-tensor sums (on the params' device; a fake one while tracing)."""
    device = params[0].device if params else torch.device("cpu")
    return torch.zeros(2 * len(params), dtype=torch.float64, device=device)


def lamb_moments_(a: dict[str, Any]) -> Tensor:
    """LAMB's first phase: the finite check, the moments and the grad write-back; returns the per-tensor sums
    of ``p^2`` (``[0, n)``) and of ``u^2`` (``[n, 2n)``) as float64 on the params' device, leaving the params and
    the steps alone. A skip (``check_finite``, which needs ``found_inf``) is reported in ``found_inf`` only, so
    pass that flag on to ``lamb_apply_``."""
    layout = _layout("lamb_moments_", LAMB, a)
    _arg_checks("lamb_moments_", layout.verdict[0], a)
    if a["check_finite"] and a["found_inf"] is None:
        raise ValueError(
            "stepforge_fused::lamb_moments_: check_finite=True needs found_inf (the skip is reported there and "
            "read by lamb_apply_)."
        )
    norms = lamb_norms_like(a["params"])
    if layout.verdict[0] is not None:
        hyper = [*(a[x.name] for x in LAMB.hyper[:8]), 0.0, math.inf]
        _update("lamb_moments_", LAMB, layout, a, hyper, advance=False, norms_out_ptr=norms.data_ptr())
    return norms


def lamb_apply_(a: dict[str, Any]) -> None:
    """LAMB's second phase: the update with trust ratios from ``norms`` (e.g. summed over ranks); reads no
    grads, skips when ``found_inf`` is raised, advances the steps otherwise. With the sums of ``lamb_moments_``
    unchanged, the two phases give the bits of ``lamb_``."""
    layout = _layout("lamb_apply_", LAMB, a)
    _arg_checks("lamb_apply_", layout.verdict[0], a)
    if layout.verdict[0] is None:
        return
    # the apply pass reads no grads: the params stand in for them (list lengths and dtype codes must be valid)
    p_ptrs, m_ptrs, v_ptrs, w_ptrs = layout.ptrs
    hyper = [a[x.name] for x in LAMB.hyper]
    _update(
        "lamb_apply_", LAMB, layout, a, hyper, ptrs=[p_ptrs, p_ptrs, m_ptrs, v_ptrs, w_ptrs],
        norms_in_ptr=a["norms"].data_ptr(),
    )  # fmt: skip


def l2norm_checks(a: dict[str, Any]) -> tuple[Any, Any]:
    """The argument checks of :func:`l2norm`."""
    tensors = a["tensors"]
    return one_device("l2norm", {"tensors": tensors}), check_list("l2norm", "tensors", tensors, len(tensors))


def l2norm(tensors: list[Tensor], per_tensor: bool) -> tuple[Tensor, Tensor]:
    """The global L2 norm of ``tensors`` (one device, one dtype) as a 0-dim tensor on their device -- float64 on
    the CPU (the kernel accumulates in double), float32 on CUDA (the root of the device sum of squares, no sync)
    -- and, with ``per_tensor``, each tensor's norm (float32, ``(n,)``; else ``(0,)``). Non-finite values
    propagate. An empty list gives 0 on the CPU."""
    layout = layout_of("l2norm", [tensors], lambda: l2norm_checks({"tensors": tensors}))
    device, dtype = layout.verdict
    if device is None or dtype is None:
        return torch.zeros((), dtype=torch.float64), torch.zeros(0, dtype=torch.float32)
    module, ctx, env = _env(device)
    each = torch.zeros(len(tensors) if per_tensor else 0, dtype=torch.float32, device=device)
    each_ptr = each.data_ptr() if per_tensor else 0
    if device.type == "cpu":
        norm = module.l2norm(layout.ptrs[0], layout.sizes, DTYPE_CODES[dtype], each_ptr, ctx)
        return torch.tensor(norm, dtype=torch.float64), each
    sumsq = torch.zeros(1, dtype=torch.float32, device=device)
    module.l2norm(
        layout.ptrs[0], layout.sizes, DTYPE_CODES[dtype], each_ptr, ctx, sumsq_out_ptr=sumsq.data_ptr(), **env
    )
    return sumsq.sqrt().reshape(()), each


def _scale_lists(src: list[Tensor], dst: list[Tensor]) -> tuple[Any, Any, Any]:
    device = one_device("scale_", {"src": src, "dst": dst})
    return (
        device,
        check_list("scale_", "src", src, len(src)),
        check_list("scale_", "dst", dst, len(src), like=src),
    )


def scale_checks(a: dict[str, Any]) -> tuple[Any, Any, Any]:
    """The argument checks of :func:`scale_`."""
    verdict = _scale_lists(a["src"], a["dst"])
    check_flag("scale_", a["found_inf"], verdict[0])
    return verdict


def scale_(src: list[Tensor], dst: list[Tensor], scale: float, found_inf: Tensor | None) -> None:
    """``dst = src * scale`` (dtype converted; ``dst`` may be ``src``); a non-finite input sets ``found_inf`` to
    1 (everything is still written: apex's ``multi_tensor_scale``)."""
    layout = layout_of("scale_", [src, dst], lambda: _scale_lists(src, dst))
    device, sdt, ddt = layout.verdict
    check_flag("scale_", found_inf, device)
    if device is None:
        return
    module, ctx, env = _env(device)
    flag = found_inf.data_ptr() if found_inf is not None else 0
    module.scale(*layout.ptrs, layout.sizes, DTYPE_CODES[sdt], DTYPE_CODES[ddt], scale, flag, ctx, **env)
