# SPDX-License-Identifier: Apache-2.0
"""LARS in pure PyTorch: ColossalAI's ``Lars`` with its hard-coded clamps as options (see :class:`Lars`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from stepforge.core import (
    HyperParameterError,
    check_bool,
    check_dampening,
    check_eps,
    check_momentum,
    check_nesterov,
    check_range,
    check_trust_clip,
    check_weight_decay,
)

from ._base import MultiTensorOptimizer, lr_of, math_dtype_of, zeros_state
from ._multi_tensor import (
    contiguous_locals,
    copy_back,
    decayed_grads,
    default_chunk_size,
    gather_pieces,
    pieces_of,
    plan_waves,
    reduce_norms,
)

__all__ = ["Lars"]


class Lars(MultiTensorOptimizer):
    r"""LARS (You, Gitman, Ginsburg, 2017, "Large Batch Training of Convolutional Networks").

    The positional signature and defaults are ColossalAI's ``Lars`` (from NUS-HPC-AI-Lab LARS-ImageNet), and
    with default arguments the trajectory is the same. ColossalAI's hard-coded element clamp (+-10) and ratio
    clamp ([0, 50]) are the ``grad_clip`` and ``trust_clip`` options; ``dampening`` and ``nesterov`` follow
    ``torch.optim.SGD``. Per parameter::

        g   = -g if maximize
        r   = eeta * ||p|| / (||g|| + wd*||p|| + epsilon)   (1 if ||p|| or ||g|| is 0)
        r   = clamp(r, *trust_clip) ;  r = 1 for excluded parameters
        d   = clamp(g + wd*p, -grad_clip, grad_clip)
        buf = d (first step) | momentum*buf + (1 - dampening)*d ;  d = d + momentum*buf if nesterov else buf
        p   = p - lr * r * d

    The ratio scales the post-momentum step (as ColossalAI; the paper folds it into the momentum). A param
    group with ``lars=False`` (ColossalAI's group key) gets neither the ratio nor weight decay;
    ``exclude_from_adaptation`` removes only the ratio, for the parameters it selects (e.g. biases and
    normalisation parameters, the usual LARS practice; :meth:`exclude_bias_and_norm` is that predicate) —
    put them in a ``weight_decay=0`` group to also skip decay.

    Args:
        params: parameters or param-group dicts (any option but ``exclude_from_adaptation`` may be per group).
        lr: learning rate, ``>= 0`` (ints are accepted, unlike ColossalAI).
        momentum: momentum factor, ``>= 0``.
        eeta: LARS trust coefficient, in ``(0, 1]``.
        weight_decay: L2 coefficient, ``>= 0`` (in ``d`` and in the ratio's denominator).
        epsilon: added to the ratio's denominator, ``>= 0``.
        dampening: as ``torch.optim.SGD`` (not applied on the first step), in ``[0, 1]``.
        nesterov: Nesterov momentum; needs ``momentum > 0`` and ``dampening == 0``.
        grad_clip: element-wise clamp of ``d`` to ``[-grad_clip, grad_clip]``; ``None`` disables (default 10).
        trust_clip: ``(low, high)`` clamp of the ratio (either may be ``None``); ``None`` disables
            (default ``(0, 50)``). Like ColossalAI it also applies to the fallback ratio 1.
        exclude_from_adaptation: ``predicate(param) -> bool``; selected parameters get ``r = 1``. Not saved in
            ``state_dict`` (pass it again when rebuilding the optimizer).
        foreach: ``None``/``True``: multi-tensor updates per (device, dtype) bucket; ``False``: one tensor at a
            time. Same math either way.
        maximize: ascend instead of descend.
        differentiable: must be ``False``.
        chunk_size: elements per multi-tensor wave; default 262144 on CPU, whole buckets elsewhere.

    State per parameter: ``momentum_buffer`` when ``momentum != 0`` (fp32 for fp16/bf16/fp32 parameters, fp64
    for fp64). ``p.grad`` is never modified; no value is copied to the host during a step.
    """

    OWNER = "Lars"
    STATE_TENSORS = ("momentum_buffer",)

    @staticmethod
    def exclude_bias_and_norm(param: torch.Tensor) -> bool:
        """``True`` for tensors with at most one dimension: biases and normalisation scales/shifts."""
        return param.ndim <= 1

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        momentum: float = 0,
        eeta: float = 1e-3,
        weight_decay: float = 0,
        epsilon: float = 0.0,
        *,
        dampening: float = 0.0,
        nesterov: bool = False,
        grad_clip: float | None = 10.0,
        trust_clip: tuple[float | None, float | None] | None = (0.0, 50.0),
        exclude_from_adaptation: Callable[[torch.Tensor], bool] | None = None,
        foreach: bool | None = None,
        maximize: bool = False,
        differentiable: bool = False,
        chunk_size: int | None = None,
    ) -> None:
        if exclude_from_adaptation is not None and not callable(exclude_from_adaptation):
            raise HyperParameterError(
                f"Lars: exclude_from_adaptation must be a callable param -> bool (e.g. Lars.exclude_bias_and_norm)"
                f" or None, got {exclude_from_adaptation!r}."
            )
        self.exclude_from_adaptation = exclude_from_adaptation
        #: ``id(group)`` -> the new-buffer flags the last step read (a compiled graph keeps reading them)
        self._first_flags: dict[int, list[torch.Tensor]] = {}
        defaults = dict(
            lr=lr,
            momentum=momentum,
            eeta=eeta,
            weight_decay=weight_decay,
            epsilon=epsilon,
            lars=True,
            dampening=dampening,
            nesterov=nesterov,
            grad_clip=grad_clip,
            trust_clip=trust_clip,
            foreach=foreach,
            maximize=maximize,
            differentiable=differentiable,
            chunk_size=chunk_size,
        )
        super().__init__(params, defaults)

    def __getstate__(self) -> dict[str, Any]:
        # torch.optim pickles defaults/state/param_groups only; the predicate is this optimizer's own setting
        return {**super().__getstate__(), "exclude_from_adaptation": self.exclude_from_adaptation}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)  # __getstate__ above saved exclude_from_adaptation with the rest
        self._first_flags = {}

    def _validate_group(self, group: Mapping[str, Any]) -> None:
        owner = self.OWNER
        super()._validate_group(group)
        check_momentum(group["momentum"], owner=owner)
        check_dampening(group["dampening"], owner=owner)
        check_weight_decay(group["weight_decay"], owner=owner)
        check_eps(group["epsilon"], owner=owner, name="epsilon")
        check_range(
            "eeta",
            group["eeta"],
            low=0.0,
            high=1.0,
            low_open=True,
            owner=owner,
            hint="eeta is the LARS trust coefficient, typically 1e-3.",
        )
        check_nesterov(group["nesterov"], group["momentum"], group["dampening"], owner=owner)
        check_bool("lars", group["lars"], owner=owner)
        if group["grad_clip"] is not None:
            check_range(
                "grad_clip",
                group["grad_clip"],
                low=0.0,
                low_open=True,
                owner=owner,
                hint="Use None to disable the element-wise clamp.",
            )
        check_trust_clip(group["trust_clip"], owner=owner)

    def _init_group(
        self,
        group: dict[str, Any],
        compiled: bool,
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        bufs: list[torch.Tensor],
        extras: list[torch.Tensor],
    ) -> tuple[tuple[int, int, bool, int], ...]:
        """Fill the lists bucket by bucket (momentum buffers created where missing); returns each bucket's
        ``(start, stop, adapt, first)``, ``first`` indexing ``extras`` for the bucket's new-buffer flags (or -1).

        A new buffer takes the update itself (torch.optim.SGD's first step): a flag tensor that the update reads
        and then clears, so that the first compiled run and the later ones share one graph."""
        exclude = self.exclude_from_adaptation

        def adapts(p: torch.Tensor) -> bool:
            return bool(group["lars"]) and not (exclude is not None and exclude(p))

        momentum = group["momentum"] != 0
        self._first_flags.pop(id(group), None)
        plan = []
        for bucket in self._buckets(group, compiled, key=adapts):
            start = len(params)
            fresh = []
            for p in bucket:
                state = self.state[p]
                fresh.append(momentum and "momentum_buffer" not in state)
                if fresh[-1]:
                    state["momentum_buffer"] = zeros_state(p)
                params.append(p)
                grads.append(p.grad)  # type: ignore[arg-type]  # buckets hold parameters with a gradient
                if momentum:
                    bufs.append(state["momentum_buffer"])
            first = -1
            if any(fresh):
                flags = torch.tensor([float(f) for f in fresh], device=bucket[0].device)
                self._first_flags.setdefault(id(group), []).append(flags)  # kept alive: the graph reads it
                first = len(extras)
                extras.append(flags)
            plan.append((start, len(params), adapts(bucket[0]), first))
        return tuple(plan)

    def _step(self) -> None:
        compiled = torch.compiler.is_compiling()
        for group in self.param_groups:
            lists: tuple[list[torch.Tensor], ...] = ([], [], [], [])
            params, grads, bufs, extras = lists
            for start, stop, adapt, first in self._init_group(group, compiled, *lists):
                flags = extras[first] if first >= 0 else None
                _update(group, [x[start:stop] for x in (params, grads, bufs)], adapt, flags, compiled)


def _update(
    group: Mapping[str, Any],
    lists: Sequence[list[Any]],
    adapt: bool,
    first: torch.Tensor | None,
    compiled: bool,
) -> None:
    """One bucket's update (``lists``: its params, grads, momentum buffers), in cache-sized waves eagerly, as one
    wave of whole tensors when compiled."""
    params, grads, bufs = lists
    like = params[0]  # DTensor parameters: local shards are updated, norms reduced over the mesh
    device, mdtype = like.device, math_dtype_of(like.dtype)
    lr, mu, damp, nesterov = lr_of(group, compiled), group["momentum"], group["dampening"], group["nesterov"]
    wd = group["weight_decay"] if group["lars"] else 0.0  # ColossalAI: lars=False groups skip decay too
    eeta, eps, clip, maximize = group["eeta"], group["epsilon"], group["grad_clip"], group["maximize"]
    params, grads, targets, bufs = contiguous_locals(params, grads, bufs)

    coef = None  # p += coef * step, one multiply-add per piece
    if adapt:
        w = reduce_norms(torch.stack(torch._foreach_norm(targets, 2, dtype=mdtype)), like)
        n = reduce_norms(torch.stack(torch._foreach_norm(grads, 2, dtype=mdtype)), like)
        ratio = torch.where((w > 0) & (n > 0), eeta * w / (n + wd * w + eps), torch.ones_like(w))
        low, high = group["trust_clip"] or (None, None)
        if low is not None or high is not None:
            ratio = ratio.clamp(min=low, max=high)
        coef = ratio * -lr

    chunk = None if compiled else group["chunk_size"] or default_chunk_size(device)
    waves = plan_waves([p.numel() for p in params], chunk, device)
    upcast_p = like.dtype != mdtype
    for wave in waves:
        p_pieces = pieces_of(targets, wave)
        p32 = [x.to(mdtype) for x in p_pieces] if upcast_p else p_pieces
        d, own = decayed_grads(pieces_of(grads, wave), p32, None, maximize, wd)
        if clip is not None:
            if not own:
                d = [x.clone() for x in d]
            torch._foreach_clamp_min_(d, -clip)
            torch._foreach_clamp_max_(d, clip)
        step = d
        if mu != 0:
            b = pieces_of(bufs, wave)
            if first is None:
                torch._foreach_mul_(b, mu)
                torch._foreach_add_(b, d, alpha=1.0 - damp)
            else:  # chosen on the device: see _init_group
                new = [
                    torch.where(first[piece.index] != 0, x, y * mu + x * (1.0 - damp))
                    for piece, x, y in zip(wave.pieces, d, b, strict=True)
                ]
                torch._foreach_copy_(b, new)
            step = torch._foreach_add(d, b, alpha=mu) if nesterov else b
        if coef is not None:
            torch._foreach_addcmul_(p32, step, gather_pieces(coef, wave))
        elif compiled:  # a tensor lr cannot be an alpha
            torch._foreach_add_(p32, torch._foreach_mul(step, -lr))
        else:
            torch._foreach_add_(p32, step, alpha=-lr)
        if upcast_p:
            torch._foreach_copy_(p_pieces, p32)
    if first is not None:
        first.zero_()
    copy_back(params, targets)
