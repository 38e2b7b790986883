# SPDX-License-Identifier: Apache-2.0
"""LAMB's two-phase ``stepforge_fused`` operators, for tensors whose norms are summed elsewhere first (sharded
parameters): ``lamb_moments_`` (moments, and the per-tensor sums of ``p^2`` and ``u^2``) and ``lamb_apply_`` (the
update from those sums). ``lamb_``, the whole update in one call, is made from :data:`~._kernels.LAMB` like the
other update operators (:mod:`._op_impls`). Registered by :mod:`._ops`."""

from __future__ import annotations

from typing import Any

import torch

from . import _op_kernels as k
from ._op_checks import check_steps, check_update
from ._op_impls import check_trust_clip_order, scalar_checks, update_layout

__all__ = ["lamb_apply_", "lamb_checks", "lamb_moments_", "lamb_norms_like"]

Tensor = torch.Tensor


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
    lists = [*layout.ptrs, layout.sizes]
    hyper = [beta1, beta2, eps, weight_decay, adam_w_mode, bias_correction, grad_averaging, use_nvlamb, 0.0,
             float("inf")]  # fmt: skip
    common = (grad_divisor, grad_divisor_tensor, found_inf, check_finite, False)
    kw: dict[str, Any] = {"norms_out_ptr": norms.data_ptr()}
    if device.type == "cpu":
        k.launch_cpu("lamb_moments_", "lamb", lists, (pdt, gdt), 0.0, None, hyper, *common, steps=steps, **kw)
    else:
        k.launch_cuda(
            "lamb_moments_",
            "lamb",
            lists,
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
    lists = [p_ptrs, p_ptrs, m_ptrs, v_ptrs, w_ptrs, layout.sizes]
    hyper = [beta1, beta2, eps, weight_decay, adam_w_mode, bias_correction, grad_averaging, use_nvlamb,
             trust_clip_min, trust_clip_max]  # fmt: skip
    common = (1.0, None, found_inf, False, stochastic_rounding)
    kw: dict[str, Any] = {"norms_in_ptr": norms.data_ptr()}
    if device.type == "cpu":
        skipped = k.launch_cpu(
            "lamb_apply_", "lamb", lists, (pdt, pdt), lr, lr_tensor, hyper, *common, steps=steps, **kw
        )
        k.finish_steps_cpu(steps, skipped)
    else:
        result = k.launch_cuda(
            "lamb_apply_",
            "lamb",
            lists,
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
