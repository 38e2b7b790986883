# SPDX-License-Identifier: Apache-2.0
"""LAMB in pure PyTorch with the known variants as explicit options (see the :class:`Lamb` docstring)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, cast

import torch

from stepforge.core import (
    HyperParameterError,
    check_betas,
    check_bool,
    check_eps,
    check_range,
    check_weight_decay,
)

from ._base import MultiTensorOptimizer, check_trust_clip, math_dtype_of
from ._compiled import as_int_steps, lr_of
from ._compiled_lamb import lamb_compiled_step, lamb_init_group
from ._dtensor import local, mesh_key, reduce_norms, reduce_square_sums
from ._multi_tensor import (
    TensorList,
    Wave,
    bucket_key,
    default_chunk_size,
    gather_pieces,
    pieces_of,
    plan_waves,
    segment_norms,
    segment_size,
    split_segments,
)

__all__ = ["Lamb"]

_MODES = ("step_size", "update")


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

    ============================  ====================  ====================================================
    option (keyword-only)         default (ColossalAI)  apex / ColossalAI ``FusedLAMB`` (``Lamb.fused_lamb``)
    ============================  ====================  ====================================================
    ``bias_correction``           ``False``             ``True``
    ``bias_correction_mode``      ``"step_size"``       ``"update"``
    ``always_adapt``              ``True``              ``False`` (``use_nvlamb=False``: no ratio w/o decay)
    ``max_grad_norm``             ``None`` (no clip)    ``1.0`` (global, all groups)
    ``trust_clip``                ``None``              ``None`` (DeepSpeed ``FusedLamb``: ``(0.01, 10)``)
    ``adam_w_mode``               ``True``              ``True`` (``False``: L2 on the gradient)
    ``grad_averaging``            ``True``              ``True``
    ============================  ====================  ====================================================

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
    # torch.compile: dynamo runs _init_group eagerly and traces _compiled_step (see _compiled_lamb)
    _init_group = lamb_init_group
    _compiled_step = lamb_compiled_step

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
        self._check_lr(group["lr"])
        check_betas(group["betas"], owner=owner)
        check_eps(group["eps"], owner=owner)
        check_weight_decay(group["weight_decay"], owner=owner)
        for name in ("adam", "bias_correction", "always_adapt", "adam_w_mode", "grad_averaging"):
            check_bool(name, group[name], owner=owner)
        check_trust_clip(group["trust_clip"], owner=owner)
        if group["bias_correction_mode"] not in _MODES:
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
        if group is not getattr(self, "defaults", None) and hasattr(self, "defaults"):
            if group["max_grad_norm"] != self.defaults["max_grad_norm"]:
                raise HyperParameterError(
                    f"{owner}: max_grad_norm={group['max_grad_norm']!r} set on a param group; the gradient norm "
                    "is global (over all groups, as in apex FusedLAMB), so pass max_grad_norm to the optimizer."
                )

    # -- the update ----------------------------------------------------------------------------------------
    def _global_clip(
        self, buckets: Sequence[tuple[list[torch.Tensor], Mapping[str, Any]]]
    ) -> torch.Tensor | None:
        """``max(1, ||G|| / max_grad_norm)``: 0-dim, fp32 (fp64 if a grad is), on the first grad's device."""
        max_norm = self.defaults["max_grad_norm"]
        if not max_norm:
            return None
        squares = []
        device = None
        for params, _ in buckets:
            grads = [local(cast(torch.Tensor, p.grad)) for p in params]  # bucketed params have grads
            device = device or grads[0].device
            norms = torch._foreach_norm(grads, 2, dtype=math_dtype_of(grads[0].dtype))
            square = reduce_square_sums(torch.stack(norms).square().sum(), params[0].grad)
            squares.append(square.to(device, non_blocking=True))
        if not squares:
            return None
        dtype = torch.float64 if any(s.dtype == torch.float64 for s in squares) else torch.float32
        total = torch.stack([s.to(dtype) for s in squares]).sum().sqrt()
        return torch.clamp(total / max_norm, min=1.0)

    def _step(self) -> None:
        buckets: list[tuple[list[torch.Tensor], Mapping[str, Any]]] = []
        for group in self.param_groups:
            params = self._params_with_grads(group)
            if not params:
                continue
            as_int_steps([self.state[p] for p in params])  # tensors after a compiled step
            for p in params:
                state = self.state[p]
                if "step" not in state:
                    sdtype = math_dtype_of(p.dtype)
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(
                        p, dtype=sdtype, memory_format=torch.contiguous_format
                    )
                    state["exp_avg_sq"] = torch.zeros_like(
                        p, dtype=sdtype, memory_format=torch.contiguous_format
                    )
                state["step"] += 1
            by_key: dict[Any, list[torch.Tensor]] = {}
            for p in params:
                by_key.setdefault((*bucket_key(p, cast(torch.Tensor, p.grad)), mesh_key(p)), []).append(p)
            if group["foreach"] is False:
                buckets.extend(([p], group) for ps in by_key.values() for p in ps)
            else:
                for ps in by_key.values():
                    limit = segment_size(ps[0].device, group["chunk_size"])
                    buckets.extend((seg, group) for seg in split_segments(ps, limit))
        clip = self._global_clip(buckets)
        for params, bucket_group in buckets:
            self._update_bucket(params, bucket_group, clip)

    def _update_bucket(
        self, params: list[torch.Tensor], group: Mapping[str, Any], clip: torch.Tensor | None
    ) -> None:
        device, pdtype = params[0].device, params[0].dtype
        mdtype = math_dtype_of(pdtype)
        beta1, beta2 = group["betas"]
        lr, eps, wd = lr_of(group), group["eps"], group["weight_decay"]
        adam_w, mode = group["adam_w_mode"], group["bias_correction_mode"]
        b3 = 1.0 - beta1 if group["grad_averaging"] else 1.0
        adapt = not group["adam"] and (wd != 0 or group["always_adapt"])
        states = [self.state[p] for p in params]
        like = params[0]  # a DTensor bucket works on local shards; its norms are reduced over the mesh
        grads = [local(cast(torch.Tensor, p.grad)) for p in params]  # bucketed params have grads
        params = [local(p) for p in params]
        # Contiguous views so that pieces are plain slices (grads of expanded/transposed params are copied once).
        if any(not g.is_contiguous() for g in grads):
            grads = [g.contiguous() for g in grads]
        strided = any(not p.is_contiguous() for p in params)
        targets = [p.contiguous() if strided else p for p in params]
        exp_avgs = [local(s["exp_avg"]) for s in states]
        exp_avg_sqs = [local(s["exp_avg_sq"]) for s in states]

        steps = [s["step"] for s in states]
        bc1 = [1.0 - beta1**t if group["bias_correction"] else 1.0 for t in steps]
        bc2 = [1.0 - beta2**t if group["bias_correction"] else 1.0 for t in steps]
        # The step-size factor: -lr * s per tensor (s = sqrt(bc2)/bc1 in "step_size" mode).
        factor = [
            -lr * (math.sqrt(c2) / c1 if mode == "step_size" else 1.0)
            for c1, c2 in zip(bc1, bc2, strict=True)
        ]

        chunk = group["chunk_size"] or default_chunk_size(device)
        waves = plan_waves([p.numel() for p in params], chunk, device)
        whole = waves[0].owners is None
        upcast_p = pdtype != mdtype
        upcast_g = grads[0].dtype != mdtype
        maximize = group["maximize"]

        def update_of(
            wave: Wave, m_pieces: list[torch.Tensor], v_pieces: list[torch.Tensor], p_pieces: TensorList
        ) -> TensorList:
            idx = [piece.index for piece in wave.pieces]
            if mode == "update" and group["bias_correction"]:
                denom = torch._foreach_div(v_pieces, [bc2[i] for i in idx])
                torch._foreach_sqrt_(denom)
                torch._foreach_add_(denom, eps)
                u = torch._foreach_div(m_pieces, [bc1[i] for i in idx])
                torch._foreach_div_(u, denom)
            else:
                # pow(v, 0.5) is computed as sqrt; out-of-place _foreach_sqrt on CPU views can be 1000x
                # slower with several threads (torch 2.13), so unary foreach ops run in place on our own copies.
                denom = torch._foreach_pow(v_pieces, 0.5)
                torch._foreach_add_(denom, eps)
                u = torch._foreach_div(m_pieces, denom)
            if adam_w and wd != 0:
                torch._foreach_add_(u, p_pieces, alpha=wd)
            return u

        # u is kept from phase 1 (norms) to phase 2 (update): a transient fp32 copy of the bucket, like torch's
        # foreach Adam temporaries; foreach=False bounds it to one tensor. (Recomputing u per wave would save
        # that memory but costs four more passes over the data.)
        kept: list[TensorList] = []
        w_norms, u_norms = [], []
        for wave in waves:
            p_pieces = pieces_of(targets, wave, whole)
            p32 = [x.to(mdtype) for x in p_pieces] if upcast_p else p_pieces
            g_pieces = pieces_of(grads, wave, whole)
            g: TensorList = [x.to(mdtype) for x in g_pieces] if upcast_g else g_pieces

            fresh = upcast_g  # g may be modified in place only when it is our own copy, never p.grad
            if clip is not None:
                g = torch._foreach_div(g, clip.to(device=device, dtype=mdtype, non_blocking=True))
                fresh = True
            if maximize:
                if fresh:
                    torch._foreach_neg_(g)
                else:
                    g = torch._foreach_mul(g, -1.0)
                fresh = True
            if not adam_w and wd != 0:
                if fresh:
                    torch._foreach_add_(g, p32, alpha=wd)
                else:
                    g = torch._foreach_add(g, p32, alpha=wd)
            m_pieces = pieces_of(exp_avgs, wave, whole)
            v_pieces = pieces_of(exp_avg_sqs, wave, whole)
            if group["grad_averaging"]:  # m + (1-beta1)*(g-m): one pass instead of two
                torch._foreach_lerp_(m_pieces, g, b3)
            else:
                torch._foreach_mul_(m_pieces, beta1)
                torch._foreach_add_(m_pieces, g, alpha=b3)
            torch._foreach_mul_(v_pieces, beta2)
            torch._foreach_addcmul_(v_pieces, g, g, value=1.0 - beta2)
            u = update_of(wave, m_pieces, v_pieces, p32)
            if adapt:
                w_norms.append((wave, torch._foreach_norm(p32)))
                u_norms.append((wave, torch._foreach_norm(u)))
            kept.append(u)

        ratio = None
        if adapt:
            w = segment_norms(w_norms, len(params), device, mdtype)
            n = segment_norms(u_norms, len(params), device, mdtype)
            w, n = reduce_norms(w, like), reduce_norms(n, like)
            ratio = torch.where((w > 0) & (n > 0), w / n, torch.ones_like(w))
            low, high = group["trust_clip"] or (None, None)
            if low is not None or high is not None:
                ratio = torch.where((w > 0) & (n > 0), ratio.clamp(min=low, max=high), ratio)

        # p += coef * u with coef = -lr * s * r per tensor, folded into one multiply-add where possible.
        uniform = all(f == factor[0] for f in factor)
        coef = None
        if ratio is not None:
            if uniform:
                coef = ratio * factor[0]
            elif device.type == "cpu":  # a host list becomes a device tensor for free only on the CPU
                coef = ratio * torch.tensor(factor, dtype=ratio.dtype)
        for k, wave in enumerate(waves):
            p_pieces = pieces_of(targets, wave, whole)
            p32 = [x.to(mdtype) for x in p_pieces] if upcast_p else p_pieces
            u = kept[k]
            if coef is not None:
                torch._foreach_addcmul_(p32, u, gather_pieces(coef, wave))
            elif ratio is not None:
                torch._foreach_mul_(u, [factor[piece.index] for piece in wave.pieces])
                torch._foreach_addcmul_(p32, u, gather_pieces(ratio, wave))
            elif uniform:
                torch._foreach_add_(p32, u, alpha=factor[0])
            else:
                torch._foreach_mul_(u, [factor[piece.index] for piece in wave.pieces])
                torch._foreach_add_(p32, u)
            if upcast_p:
                torch._foreach_copy_(p_pieces, p32)
        if strided:
            for p, t in zip(params, targets, strict=True):
                p.copy_(t)
