# SPDX-License-Identifier: Apache-2.0
"""LAMB in pure PyTorch with the known variants as explicit options (see the :class:`Lamb` docstring)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import torch

from stepforge.core import (
    HyperParameterError,
    check_betas,
    check_bool,
    check_eps,
    check_range,
    check_trust_clip,
    check_weight_decay,
)
from stepforge.core.torch_compat import dtensor_local as local  # the shard itself, same storage

from ._base import MultiTensorOptimizer, lr_of, math_dtype_of, zeros_state
from ._multi_tensor import (
    TensorList,
    contiguous_locals,
    copy_back,
    decayed_grads,
    default_chunk_size,
    gather_pieces,
    pieces_of,
    plan_waves,
    reduce_norms,
    reduce_square_sums,
    segment_norms,
)

__all__ = ["Lamb"]


class Lamb(MultiTensorOptimizer):
    r"""LAMB (You et al., 2019, "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes").

    The positional signature and defaults are ColossalAI's ``Lamb`` (from cybertronai/pytorch-lamb), and with
    default arguments the trajectory is the same. Keyword-only options select the other known variants; per
    parameter, with ``t`` its step::

        g  = g / c,  c = max(1, ||G||/max_grad_norm)   # global grad norm over all groups (max_grad_norm)
        g  = -g if maximize ;  g = g + wd*p if not adam_w_mode
        m  = beta1*m + b3*g  (b3 = 1-beta1, or 1 if not grad_averaging) ;  v = beta2*v + (1-beta2)*g*g
        "update":    u = (m/bc1) / (sqrt(v/bc2) + eps),  s = 1            (bc = 1 - beta**t, apex FusedLAMB)
        "step_size": u = m / (sqrt(v) + eps),            s = sqrt(bc2)/bc1 (ColossalAI Lamb; pytorch-lamb)
        (bias_correction=False: bc1 = bc2 = 1)
        u  = u + wd*p if adam_w_mode                      # decay inside u, hence inside the trust ratio
        r  = ||p|| / ||u|| (1 if either is 0), clamped to trust_clip
        r  = 1 if adam, or if wd == 0 and not always_adapt
        p  = p - lr * s * r * u

    :meth:`fused_lamb` selects apex / ColossalAI ``FusedLAMB``'s variant (``bias_correction=True`` in
    ``"update"`` mode, ``always_adapt=False``, ``max_grad_norm=1.0``); DeepSpeed ``FusedLamb`` also clamps the
    ratio (``trust_clip=(0.01, 10)``).

    Args:
        params: parameters or param-group dicts (any of the options above may be set per group, except
            ``max_grad_norm``, which is global as in apex).
        lr: learning rate, ``>= 0``.
        betas: ``(beta1, beta2)``, each in ``[0, 1)``.
        eps: added to ``sqrt(v)``, ``>= 0``.
        weight_decay: decoupled (``adam_w_mode=True``) or L2 coefficient, ``>= 0``.
        adam: force ``r = 1`` (plain Adam with LAMB's decay placement; ColossalAI's comparison switch).
        bias_correction: use ``bc1``/``bc2`` (where: ``bias_correction_mode``).
        trust_clip: ``(low, high)`` clamp of the computed ratio (either bound may be ``None``), or ``None``.
        always_adapt: apply the ratio also to groups with ``weight_decay == 0`` (apex ``use_nvlamb``).
        bias_correction_mode: ``"step_size"`` or ``"update"`` (see above).
        max_grad_norm: clip the global gradient norm to this value first; ``None`` or ``0`` disables.
        adam_w_mode: as apex ``FusedLAMB``.
        grad_averaging: as apex ``FusedLAMB``.
        foreach: ``None``/``True``: multi-tensor ``torch._foreach_*`` updates per (device, dtype) bucket;
            ``False``: one tensor at a time (lowest temporary memory). Same math either way.
        maximize: ascend instead of descend.
        differentiable: must be ``False`` (accepted for signature compatibility).
        chunk_size: elements per multi-tensor wave; default 262144 on CPU (cache-sized), whole buckets elsewhere.

    State per parameter: ``step`` (int), ``exp_avg``, ``exp_avg_sq`` (fp32 for fp16/bf16/fp32 parameters, fp64
    for fp64). Low-precision parameters are updated in fp32 and rounded once per step (no master copy is kept:
    use fp32 parameters, or a mixed-precision wrapper, for master weights). ``p.grad`` is never modified, and no
    value is copied to the host during a step.
    """

    OWNER = "Lamb"
    STATE_TENSORS = ("exp_avg", "exp_avg_sq")
    STATE_SCALARS = ("step",)

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0,
        adam: bool = False,
        bias_correction: bool = False,
        *,
        trust_clip: tuple[float | None, float | None] | None = None,
        always_adapt: bool = True,
        bias_correction_mode: Literal["step_size", "update"] = "step_size",
        max_grad_norm: float | None = None,
        adam_w_mode: bool = True,
        grad_averaging: bool = True,
        foreach: bool | None = None,
        maximize: bool = False,
        differentiable: bool = False,
        chunk_size: int | None = None,
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            adam=adam,
            bias_correction=bias_correction,
            trust_clip=trust_clip,
            always_adapt=always_adapt,
            bias_correction_mode=bias_correction_mode,
            max_grad_norm=max_grad_norm,
            adam_w_mode=adam_w_mode,
            grad_averaging=grad_averaging,
            foreach=foreach,
            maximize=maximize,
            differentiable=differentiable,
            chunk_size=chunk_size,
        )
        super().__init__(params, defaults)

    @classmethod
    def fused_lamb(
        cls,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        adam_w_mode: bool = True,
        weight_decay: float = 0.01,
        grad_averaging: bool = True,
        max_grad_norm: float = 1.0,
        use_nvlamb: bool = False,
        **kwargs: Any,
    ) -> Lamb:
        """A :class:`Lamb` with apex/ColossalAI ``FusedLAMB``'s signature, defaults and math.

        Differences kept on purpose: ``p.grad`` is not overwritten with the update, and ``max_grad_norm=0``
        disables clipping (apex would divide every gradient by ``inf``).
        """
        return cls(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            bias_correction_mode="update",
            always_adapt=use_nvlamb,
            max_grad_norm=max_grad_norm,
            adam_w_mode=adam_w_mode,
            grad_averaging=grad_averaging,
            **kwargs,
        )

    # -- validation ----------------------------------------------------------------------------------------
    def _validate_group(self, group: Mapping[str, Any]) -> None:
        owner = self.OWNER
        super()._validate_group(group)
        check_betas(group["betas"], owner=owner)
        check_eps(group["eps"], owner=owner)
        check_weight_decay(group["weight_decay"], owner=owner)
        for name in ("adam", "bias_correction", "always_adapt", "adam_w_mode", "grad_averaging"):
            check_bool(name, group[name], owner=owner)
        check_trust_clip(group["trust_clip"], owner=owner)
        if group["bias_correction_mode"] not in ("step_size", "update"):
            raise HyperParameterError(
                f"{owner}: invalid bias_correction_mode={group['bias_correction_mode']!r}; use 'step_size' "
                "(bias correction scales the step, ColossalAI Lamb) or 'update' (inside u, apex FusedLAMB)."
            )
        if group["max_grad_norm"] is not None:
            check_range(
                "max_grad_norm",
                group["max_grad_norm"],
                low=0.0,
                owner=owner,
                hint="Use None (or 0) to disable global gradient clipping.",
            )
        if group["max_grad_norm"] != self.defaults["max_grad_norm"]:
            raise HyperParameterError(
                f"{owner}: max_grad_norm={group['max_grad_norm']!r} set on a param group; the gradient norm "
                "is global (over all groups, as in apex FusedLAMB), so pass max_grad_norm to the optimizer."
            )

    # -- the update ----------------------------------------------------------------------------------------
    def _init_group(
        self,
        group: dict[str, Any],
        compiled: bool,
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        exp_avgs: list[torch.Tensor],
        exp_avg_sqs: list[torch.Tensor],
        steps: list[Any],
    ) -> tuple[tuple[int, int], ...]:
        """Fill the lists bucket by bucket (state created where missing); returns each bucket's ``(start, stop)``.

        ``step`` is an int advanced here, or compiled a float32 tensor on the parameter's device (torch.optim's
        layout) that the graph advances, so a new step value does not recompile.
        """
        plan = []
        for bucket in self._buckets(group, compiled):
            start = len(params)
            for p in bucket:
                state = self.state[p]
                if "step" not in state:
                    state.update(step=0, exp_avg=zeros_state(p), exp_avg_sq=zeros_state(p))
                if compiled:
                    state["step"] = torch.as_tensor(state["step"], dtype=torch.float32, device=p.device)
                else:  # an int again after compiled steps
                    state["step"] = int(state["step"]) + 1
                params.append(p)
                grads.append(p.grad)  # type: ignore[arg-type]  # buckets hold parameters with a gradient
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                steps.append(state["step"])
            plan.append((start, len(params)))
        return tuple(plan)

    def _step(self) -> None:
        compiled = torch.compiler.is_compiling()
        buckets = []
        for group in self.param_groups:
            lists: tuple[list[Any], ...] = ([], [], [], [], [])
            for start, stop in self._init_group(group, compiled, *lists):
                buckets.append((group, [x[start:stop] for x in lists]))
        clip = None  # max(1, ||G|| / max_grad_norm), G: every gradient; fp32 (fp64 if a grad is)
        max_norm = self.defaults["max_grad_norm"]
        if max_norm and buckets:
            device = local(buckets[0][1][1][0]).device
            squares = []
            for _group, (_params, grads, *_state) in buckets:
                shards = [local(g) for g in grads]
                norms = torch._foreach_norm(shards, 2, dtype=math_dtype_of(shards[0].dtype))
                square = reduce_square_sums(torch.stack(list(norms)).square().sum(), grads[0])
                squares.append(square.to(device, non_blocking=True))
            dtype = torch.float64 if any(s.dtype == torch.float64 for s in squares) else torch.float32
            clip = torch.clamp(torch.stack([s.to(dtype) for s in squares]).sum().sqrt() / max_norm, min=1.0)
        for group, bucket in buckets:
            _update(group, bucket, clip, compiled)


def _update(
    group: Mapping[str, Any], lists: Sequence[list[Any]], clip: torch.Tensor | None, compiled: bool
) -> None:
    """One bucket's update (``lists``: its params, grads, exp_avgs, exp_avg_sqs, steps): ``u`` and the norms of
    every wave, then ``p``; eagerly in cache-sized waves.

    Compiled, the bucket is one wave of whole tensors, the bias corrections are float64 tensor math on the step
    tensors (eagerly Python floats), and ``u`` is per-tensor element-wise expressions and norms instead of
    ``torch._foreach_*`` (inductor realises every foreach output as a buffer): inductor computes ``u`` inside
    the norm's loop and again inside the update's and holds none (``test_compiled_lamb_keeps_no_update_buffer``).
    Inductor rounds like the eager foreach calls except where ATen contracts a multiply-add: a few ulp apart.
    """
    params, grads, exp_avgs, exp_avg_sqs, steps = lists
    like = params[0]  # a DTensor bucket works on local shards; its norms are reduced over the mesh
    device, mdtype = like.device, math_dtype_of(like.dtype)
    beta1, beta2 = group["betas"]
    lr, eps, wd = lr_of(group, compiled), group["eps"], group["weight_decay"]
    inside = group["bias_correction"] and group["bias_correction_mode"] == "update"  # bias correction in u
    scaled = group["bias_correction"] and group["bias_correction_mode"] == "step_size"  # ... in the step
    adapt = not group["adam"] and (wd != 0 or group["always_adapt"])
    params, grads, targets, exp_avgs, exp_avg_sqs = contiguous_locals(params, grads, exp_avgs, exp_avg_sqs)
    # The step-size factor: -lr * s per tensor (s = sqrt(bc2)/bc1 in "step_size" mode); eagerly a list of floats.
    factor: Any
    if compiled:
        torch._foreach_add_(steps, 1.0)
        t = torch.stack(steps).to(torch.float64)
        bc1, bc2 = 1.0 - beta1**t, 1.0 - beta2**t
        lr64 = lr.to(torch.float64) if isinstance(lr, torch.Tensor) else lr
        factor = (-lr64 * (bc2.sqrt() / bc1 if scaled else torch.ones_like(t))).to(mdtype)
        bc1, bc2 = bc1.to(mdtype), bc2.to(mdtype)
    else:
        bc1 = [1.0 - beta1**t for t in steps]
        bc2 = [1.0 - beta2**t for t in steps]
        factor = [-lr * (math.sqrt(c2) / c1 if scaled else 1.0) for c1, c2 in zip(bc1, bc2, strict=True)]
    chunk = None if compiled else group["chunk_size"] or default_chunk_size(device)
    waves = plan_waves([p.numel() for p in params], chunk, device)
    upcast_p = like.dtype != mdtype

    # u is kept from phase 1 (norms) to phase 2 (update): a transient fp32 copy of the segment, like torch's
    # foreach Adam temporaries; foreach=False bounds it to one tensor. (Recomputing u per wave would save
    # that memory but costs four more passes over the data.)
    kept: list[TensorList] = []
    w_norms, u_norms = [], []
    for wave in waves:
        p_pieces = pieces_of(targets, wave)
        p32 = [x.to(mdtype) for x in p_pieces] if upcast_p else p_pieces
        m = pieces_of(exp_avgs, wave)
        v = pieces_of(exp_avg_sqs, wave)
        l2 = 0.0 if group["adam_w_mode"] else wd
        g, _ = decayed_grads(pieces_of(grads, wave), p32, clip, group["maximize"], l2)
        if group["grad_averaging"]:  # m + (1-beta1)*(g-m): one pass instead of two
            torch._foreach_lerp_(m, g, 1.0 - beta1)
        else:
            torch._foreach_mul_(m, beta1)
            torch._foreach_add_(m, g)
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, g, g, value=1.0 - beta2)
        idx = [piece.index for piece in wave.pieces]
        u: TensorList
        if compiled:
            if inside:
                u = [(x / bc1[i]) / ((y / bc2[i]).sqrt() + eps) for i, x, y in zip(idx, m, v, strict=True)]
            else:
                u = [x / (y.pow(0.5) + eps) for x, y in zip(m, v, strict=True)]
            if group["adam_w_mode"] and wd != 0:
                u = [x + p * wd for x, p in zip(u, p32, strict=True)]
        else:
            if inside:
                denom = torch._foreach_div(v, [bc2[i] for i in idx])
                torch._foreach_sqrt_(denom)
            else:
                # pow(v, 0.5) is computed as sqrt; out-of-place _foreach_sqrt on CPU views can be 1000x
                # slower with several threads (torch 2.13), so unary foreach ops run in place on our own copies.
                denom = torch._foreach_pow(v, 0.5)
            torch._foreach_add_(denom, eps)
            if inside:
                u = torch._foreach_div(m, [bc1[i] for i in idx])
                torch._foreach_div_(u, denom)
            else:
                u = torch._foreach_div(m, denom)
            if group["adam_w_mode"] and wd != 0:
                torch._foreach_add_(u, p32, alpha=wd)
        if adapt:
            w_norms.append((wave, torch._foreach_norm(p32)))
            u_norm = [torch.linalg.vector_norm(x) for x in u] if compiled else torch._foreach_norm(u)
            u_norms.append((wave, u_norm))
        kept.append(u)

    ratio = None
    if adapt:
        w = reduce_norms(segment_norms(w_norms, len(params), device, mdtype), like)
        n = reduce_norms(segment_norms(u_norms, len(params), device, mdtype), like)
        computed = (w > 0) & (n > 0)  # r = ||p|| / ||u||, 1 where either is 0; a computed r is clamped
        ratio = torch.where(computed, w / n, torch.ones_like(w))
        low, high = group["trust_clip"] or (None, None)
        if low is not None or high is not None:
            ratio = torch.where(computed, ratio.clamp(min=low, max=high), ratio)

    # p += coef * u with coef = -lr * s * r per tensor: one multiply-add per piece. Eagerly, per-tensor factors
    # (tensors at different steps) are applied to u first: a host list would cost a host-to-device copy.
    per_tensor = not compiled and any(f != factor[0] for f in factor)
    scale = 1.0 if compiled or per_tensor else factor[0]
    if compiled:
        coef = factor if ratio is None else ratio * factor
    else:
        coef = None if ratio is None else ratio * scale
    for wave, u in zip(waves, kept, strict=True):
        p_pieces = pieces_of(targets, wave)
        p32 = [x.to(mdtype) for x in p_pieces] if upcast_p else p_pieces
        if per_tensor:
            torch._foreach_mul_(u, [factor[piece.index] for piece in wave.pieces])
        if coef is not None:
            torch._foreach_addcmul_(p32, u, gather_pieces(coef, wave))
        else:
            torch._foreach_add_(p32, u, alpha=scale)
        if upcast_p:
            torch._foreach_copy_(p_pieces, p32)
    copy_back(params, targets)
