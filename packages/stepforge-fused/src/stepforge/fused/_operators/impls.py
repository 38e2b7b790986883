# SPDX-License-Identifier: Apache-2.0
"""The implementations of the ``stepforge_fused`` operators (registered by :mod:`stepforge.fused._operators`,
which also documents them): the update operators ``adam_``, ``sgd_``, ``lamb_``, each made from its
:class:`~stepforge.fused._backend.KernelSpec` by :func:`update_operator`; LAMB's two phases for tensors whose
norms are summed elsewhere first (sharded parameters), ``lamb_moments_`` (moments, and the per-tensor sums of
``p^2`` and ``u^2``) and ``lamb_apply_`` (the update from those sums); ``l2norm`` and ``scale_``. Each checks,
then makes one kernel call through :mod:`.kernels`.

Each operator's checks come in two parts: those of its tensor lists, run through the layout cache
(:func:`.layouts.layout_of`: a layout accepted before is not checked again), and those of its other arguments
(steps, one-element tensors, flags), run at every call. The ``*_checks`` functions run both on the arguments as
given: the fake implementations call them while ``torch.compile`` traces.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from .._backend import LAMB, KernelSpec
from . import kernels as k
from .checks import check_flag, check_list, check_scalar_tensor, check_steps, check_update, one_device
from .layouts import Layout, layout_of

__all__ = [
    "l2norm",
    "l2norm_checks",
    "lamb_apply_",
    "lamb_checks",
    "lamb_moments_",
    "lamb_norms_like",
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
    op = spec.op

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
        steps, first_run, found_inf = a.get("steps"), a.get("first_run"), a["found_inf"]
        flags = first_run.to(torch.int64).tolist() if first_run is not None else None
        lists = (list(layout.ptrs), layout.sizes, (pdt, gdt))  # type: ignore[assignment]
        common = (
            a["grad_divisor"],
            a["grad_divisor_tensor"],
            found_inf,
            a["check_finite"],
            a["stochastic_rounding"],
        )
        if device.type == "cpu":
            skipped = k.launch_cpu(  # type: ignore[call-arg, misc]
                op,
                spec,
                *lists,
                a["lr"],
                a["lr_tensor"],
                list(args[hyper]),
                *common,
                steps=steps,
                first_run=flags,
            )
            k.finish_steps_cpu(steps, skipped)
        else:
            result = k.launch_cuda(  # type: ignore[call-arg, misc]
                op, spec, *lists, device, a["lr"], a["lr_tensor"], list(args[hyper]), *common,
                a["seed"], steps=steps, first_run=flags,
            )  # fmt: skip
            k.finish_steps_cuda(steps, found_inf, result)
            skipped = False  # decided on the device: SGD's host flags are cleared either way, as the eager step does
        if first_run is not None and not skipped:
            first_run.zero_()

    update.__name__ = op
    update.__qualname__ = op
    update.__doc__ = (
        f"The ``{op}`` operator over the ``{spec.kernel}`` kernel (arguments: {', '.join(names)})."
    )
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


Tensor = torch.Tensor  # type: ignore[misc]


def _lamb_args(
    op: str,
    device: Any,
    n: int,
    steps: Tensor,
    lr_tensor: Tensor | None,
    divisor: Tensor | None,
    flag: Tensor | None,
    norms: Tensor | None,
    trust_clip_min: float,
    trust_clip_max: float,
) -> None:
    """The checks of a LAMB operator's arguments other than its tensor lists (run at every call)."""
    check_steps(op, steps, n, device)
    scalar_checks(op, device, lr_tensor, divisor, flag)
    check_trust_clip_order(op, trust_clip_min, trust_clip_max)
    if norms is not None and (
        norms.dtype != torch.float64 or norms.numel() != 2 * n or not norms.is_contiguous()
    ):
        raise ValueError(
            f"stepforge_fused::{op}: norms must be the contiguous float64 (2n,) tensor lamb_moments_ returns "
            f"(n = {n}), got shape {tuple(norms.shape)} {norms.dtype}."
        )
    if norms is not None and device is not None and norms.device != device:
        raise RuntimeError(f"stepforge_fused::{op}: norms is on {norms.device}; it must be on {device}.")


def lamb_checks(
    *,
    params: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    masters: list[Tensor],
    steps: Tensor,
    grads: list[Tensor] | None = None,
    lr_tensor: Tensor | None = None,
    grad_divisor_tensor: Tensor | None = None,
    found_inf: Tensor | None = None,
    norms: Tensor | None = None,
    trust_clip_min: float = 0.0,
    trust_clip_max: float = 0.0,
    op: str = "",
    **_: Any,
) -> tuple[Any, Any, Any]:
    """The argument checks of the two LAMB phases (by name; ``grads`` absent for ``lamb_apply_``, ``norms``
    present only there; ``op`` names the operator in messages, by default ``lamb_apply_``); their fake
    implementations run them."""
    op = op or "lamb_apply_"
    states = {"exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}
    device, pdt, gdt = check_update(op, params, grads, states, masters, None)
    _lamb_args(
        op, device, len(params), steps, lr_tensor, grad_divisor_tensor, found_inf, norms, trust_clip_min,
        trust_clip_max,
    )  # fmt: skip
    return device, pdt, gdt


def lamb_norms_like(params: list[Tensor]) -> Tensor:
    """The ``(2n,)`` float64 buffer of the per-tensor sums (on the params' device; a fake one while tracing)."""
    device = params[0].device if params else torch.device("cpu")
    return torch.zeros(2 * len(params), dtype=torch.float64, device=device)


def lamb_moments_(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    masters: list[Tensor],
    steps: Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adam_w_mode: bool,
    bias_correction: bool,
    grad_averaging: bool,
    use_nvlamb: bool,
    grad_divisor: float,
    grad_divisor_tensor: Tensor | None,
    found_inf: Tensor | None,
    check_finite: bool,
) -> Tensor:
    """LAMB's first phase: the finite check, the moments and the grad write-back; returns the per-tensor sums
    of ``p^2`` (``[0, n)``) and of ``u^2`` (``[n, 2n)``) as float64 on the params' device, leaving the params and
    the steps alone. A skip (``check_finite``, which needs ``found_inf``) is reported in ``found_inf`` only, so
    pass that flag on to :func:`lamb_apply_`."""
    states = {"exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}
    layout = update_layout("lamb_moments_", params, grads, states, masters)
    device, pdt, gdt = layout.verdict
    _lamb_args(
        "lamb_moments_", device, len(params), steps, None, grad_divisor_tensor, found_inf, None, 0.0, 0.0
    )
    if check_finite and found_inf is None:
        raise ValueError(
            "stepforge_fused::lamb_moments_: check_finite=True needs found_inf (the skip is reported there and "
            "read by lamb_apply_)."
        )
    norms = lamb_norms_like(params)
    if device is None:
        return norms
    lists = list(layout.ptrs)
    hyper = [beta1, beta2, eps, weight_decay, adam_w_mode, bias_correction, grad_averaging, use_nvlamb, 0.0,
             float("inf")]  # fmt: skip
    common = (grad_divisor, grad_divisor_tensor, found_inf, check_finite, False)
    kw: dict[str, Any] = {"norms_out_ptr": norms.data_ptr()}
    if device.type == "cpu":
        k.launch_cpu(
            "lamb_moments_",
            LAMB,
            lists,
            layout.sizes,
            (pdt, gdt),
            0.0,
            None,
            hyper,
            *common,
            steps=steps,
            **kw,
        )
    else:
        k.launch_cuda(
            "lamb_moments_",
            LAMB,
            lists,
            layout.sizes,
            (pdt, gdt),
            device,
            0.0,
            None,
            hyper,
            *common,
            0,
            steps=steps,
            **kw,
        )
        steps.sub_(1.0)  # the device kernel read step + 1; this phase does not advance
    return norms


def lamb_apply_(
    params: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    masters: list[Tensor],
    steps: Tensor,
    norms: Tensor,
    lr: float,
    lr_tensor: Tensor | None,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adam_w_mode: bool,
    bias_correction: bool,
    grad_averaging: bool,
    use_nvlamb: bool,
    trust_clip_min: float,
    trust_clip_max: float,
    found_inf: Tensor | None,
    stochastic_rounding: bool,
    seed: int,
) -> None:
    """LAMB's second phase: the update with trust ratios from ``norms`` (e.g. summed over ranks); reads no
    grads, skips when ``found_inf`` is raised, advances the steps otherwise. With the sums of
    :func:`lamb_moments_` unchanged, the two phases give the bits of :func:`lamb_`."""
    states = {"exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}
    layout = update_layout("lamb_apply_", params, None, states, masters)
    device, pdt, _ = layout.verdict
    _lamb_args(
        "lamb_apply_", device, len(params), steps, lr_tensor, None, found_inf, norms, trust_clip_min,
        trust_clip_max,
    )  # fmt: skip
    if device is None:
        return
    # the apply pass reads no grads: the params stand in for them (list lengths and dtype codes must be valid)
    p_ptrs, m_ptrs, v_ptrs, w_ptrs = layout.ptrs
    lists = [p_ptrs, p_ptrs, m_ptrs, v_ptrs, w_ptrs]
    hyper = [beta1, beta2, eps, weight_decay, adam_w_mode, bias_correction, grad_averaging, use_nvlamb,
             trust_clip_min, trust_clip_max]  # fmt: skip
    common = (1.0, None, found_inf, False, stochastic_rounding)
    kw: dict[str, Any] = {"norms_in_ptr": norms.data_ptr()}
    if device.type == "cpu":
        skipped = k.launch_cpu(
            "lamb_apply_",
            LAMB,
            lists,
            layout.sizes,
            (pdt, pdt),
            lr,
            lr_tensor,
            hyper,
            *common,
            steps=steps,
            **kw,
        )
        k.finish_steps_cpu(steps, skipped)
    else:
        result = k.launch_cuda(
            "lamb_apply_",
            LAMB,
            lists,
            layout.sizes,
            (pdt, pdt),
            device,
            lr,
            lr_tensor,
            hyper,
            *common,
            seed,
            steps=steps,
            **kw,
        )
        k.finish_steps_cuda(steps, found_inf, result)
