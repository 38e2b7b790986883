# SPDX-License-Identifier: Apache-2.0
"""The step of the fused optimizers under ``torch.compile``: what dynamo runs eagerly and what it traces.

Under dynamo ``step()`` takes :func:`traced_step`, one graph without breaks. Dynamo runs the optimizer's
``_init_group(group, <empty lists>...)`` (:func:`init_group`) eagerly: argument checks, state creation and the
grouping into buckets (the eager step's :func:`.buckets.stage`) and the tensors the graph mutates besides the
state lists (each bucket's steps as one flat tensor, skip flags); the lists become graph inputs and its return
value, one :class:`BucketPlan` per bucket, a constant. The graph holds the inf/NaN pre-check and LAMB's global clip
as tensor ops and one operator call per bucket (:func:`.._backend.call_operator`), which inductor runs in place on
the parameters and state: the eager step's kernels, scalars and decisions, so bit-identical results. A tensor lr is
read by the graph (an LR scheduler writing it in place never recompiles); a float lr is a constant of the graph.

Without the operators (:func:`stepforge.fused.ops.available`) the step runs eagerly inside the compiled code: a
graph break, announced by one warning (``fullgraph=True`` then raises dynamo's error).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from .. import ops as _ops
from .._backend import call_operator
from .._distributed import is_dtensor
from .._validate import div_scale_divisor
from .buckets import bucket_steps, stage
from .device import clip_divisor_from_sumsq
from .protocol import KernelOwner

__all__ = ["BucketPlan", "init_group", "prepare_fallback", "traced_step"]


class BucketPlan(NamedTuple):
    """Where one bucket of a compiled step lies in the lists ``_init_group`` filled: its slices of the
    params/grads/state lists (``start:stop``) and of the masters list, its device, and the positions in ``extras``
    (``-1``: none) of its device's skip flag and counter, its SGD first-run flags and its step counts. Returned as
    a plain tuple: dynamo makes constants of the return value and cannot rebuild this class."""

    start: int
    stop: int
    masters_start: int
    masters_stop: int
    device: str
    flag: int
    count: int  # type: ignore[assignment]
    first_run: int
    steps: int


_warned: set[str] = set()


def _eager(
    step: Callable[[KernelOwner, Any, float], Any], opt: KernelOwner, closure: Any, div_scale: float
) -> Any:
    if opt._owner not in _warned:
        _warned.add(opt._owner)
        warnings.warn(
            f"stepforge-fused: torch.compile runs {opt._owner}.step() eagerly (a graph break), because "
            f"{_ops.unavailable_reason()}.",
            RuntimeWarning,
            stacklevel=3,
        )
    return step(opt, closure, div_scale)


#: The eager step behind ``torch.compiler.disable`` (the compiled code breaks there and calls it), made by
#: :func:`prepare_fallback` only without the operators: it imports torch._dynamo (about a second), which an
#: ``import stepforge.fused`` must not cost.
_fallback: list[Callable[[Any, Any, float], Any]] = []


def prepare_fallback(step: Callable[[KernelOwner, Any, float], Any]) -> None:
    """Called when an optimizer is built: without the operators, prepare the eager ``step`` compiled code calls."""
    if not _ops.available() and not _fallback:
        _fallback.append(torch.compiler.disable(functools.partial(_eager, step)))


def init_group(
    opt: KernelOwner,
    group: dict[str, Any],
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    state_a: list[torch.Tensor],
    state_b: list[torch.Tensor],
    masters: list[torch.Tensor],
    extras: list[torch.Tensor],
) -> tuple[tuple[Any, ...], ...]:
    """Fill the lists with ``group``'s parameters that have a gradient, bucket by bucket (``state_a``/``state_b``:
    the state tensors in ``_state_keys(group)`` order; ``extras``: the plan's steps and flags), and return one
    :class:`BucketPlan`'s fields per bucket."""
    opt._groups.revalidate(opt.param_groups)
    owner = opt._owner
    amp = vars(opt)  # GradScaler's attributes, set on the optimizer only during its step() call
    if amp.get("grad_scale") is not None or amp.get("found_inf") is not None:
        raise RuntimeError(
            f"{owner}: a compiled step() does not take torch.amp.GradScaler's grad_scale/found_inf; call "
            "scaler.step(optimizer) outside torch.compile, or unscale first (scaler.unscale_(optimizer)) and "
            "compile optimizer.step()."
        )
    for i, p in enumerate(group["params"]):
        if is_dtensor(p):
            raise RuntimeError(
                f"{owner}: parameter #{i} is a DTensor (FSDP2); a compiled step() steps plain tensors only. Call "
                "optimizer.step() outside torch.compile for sharded parameters."
            )
    keys = opt._state_keys(group)
    check = opt.skip_nonfinite if opt.skip_nonfinite is not None else opt.master_weights
    staged = stage(opt, group, group["params"], [p.grad for p in group["params"]])
    opt._compile_first_run.pop(id(group), None)
    plan: list[tuple[Any, ...]] = []
    index: dict[int, int] = {}  # id(extra tensor) -> its position in extras (each tensor once)

    def extra(t: torch.Tensor) -> int:
        if id(t) not in index:
            index[id(t)] = len(extras)
            extras.append(t)
        return index[id(t)]

    for (device, _pdt, _gdt, master), entries in staged.items():
        start, m_start = len(params), len(masters)
        for p, g, state, _fresh in entries:
            params.append(p)
            grads.append(g)
            if keys:
                state_a.append(state[keys[0]])
            if len(keys) > 1:
                state_b.append(state[keys[1]])
            if master:
                masters.append(state["master_param"])
        flag = count = first = steps = -1
        if opt._uses_steps:
            steps = extra(bucket_steps([e.state for e in entries], device))
        if check:
            skips = opt._skips
            flag = extra(skips.device_flag(device, None))
            count = extra(skips.counts.setdefault(device, torch.zeros(1, dtype=torch.float32, device=device)))
        if any(e.fresh for e in entries) and "momentum_buffer" in keys:
            # SGD: buffers created now take the gradient itself on the first compiled run (torch's first step)
            flags = torch.tensor([int(e.fresh) for e in entries], dtype=torch.int64)
            opt._compile_first_run.setdefault(id(group), []).append(flags)  # kept alive: the graph reads it
            first = extra(flags)
        fields = BucketPlan(start, len(params), m_start, len(masters), str(device), flag, count, first, steps)
        plan.append(tuple(fields))
    # the eager step's buckets may hold step tensors replaced above: they are rebuilt at the next eager step
    opt._bucket_cache.invalidate()
    return tuple(plan)


def traced_step(opt: KernelOwner, closure: Any, div_scale: float) -> Any:
    """The compiled step (traced by dynamo; see the module docstring)."""
    if not _ops.available():
        return _fallback[0](opt, closure, div_scale)
    divisor = div_scale_divisor(opt._owner, div_scale)
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    opt._skips.begin_step()
    work = []
    for group in opt.param_groups:
        params: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        state_a: list[torch.Tensor] = []
        state_b: list[torch.Tensor] = []
        masters: list[torch.Tensor] = []
        extras: list[torch.Tensor] = []
        plan = opt._init_group(group, params, grads, state_a, state_b, masters, extras)
        for fields in plan:
            b = BucketPlan(*fields)
            lists = [
                params[b.start : b.stop],
                grads[b.start : b.stop],
                *(s[b.start : b.stop] for s in (state_a, state_b)[: len(opt._kernel.states)]),
                masters[b.masters_start : b.masters_stop],
            ]
            work.append((group, lists, b, extras))
    if not work:
        return loss
    check = opt.skip_nonfinite if opt.skip_nonfinite is not None else opt.master_weights
    clip = opt._device_clip_norm()
    flags: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for _group, _lists, b, extras in work:
        if b.flag >= 0:
            flags[b.device] = (extras[b.flag], extras[b.count])
    need_norms = clip > 0 or (check and len(work) > 1)
    norms = (
        [torch.ops.stepforge_fused.l2norm(lists[1], False)[0] for _g, lists, _b, _e in work]
        if need_norms
        else []
    )
    kernel_check = check and len(work) == 1
    for flag, _count in flags.values():
        flag.zero_()
    if check and not kernel_check:
        # several buckets: the whole step is skipped on a non-finite gradient, so every bucket is checked first
        home = norms[0].device
        bad = torch.stack([(~torch.isfinite(n / divisor)).to(home) for n in norms]).any()
        for flag, _count in flags.values():
            flag.copy_(bad.to(device=flag.device, dtype=torch.float32).reshape(1))
    divisor_tensor: torch.Tensor | None = None
    if clip > 0:
        # LAMB's global clip, in the eager step's order: total = sum ||g_b||^2, c = max(1, sqrt(total)/div/max)
        home = norms[0].device
        total = norms[0].to(home) * norms[0].to(home)
        for n in norms[1:]:
            total = total + n.to(home) * n.to(home)
        divisor_tensor = clip_divisor_from_sumsq(total, divisor=divisor, max_norm=clip)[0]
    spec = opt._kernel
    for group, lists, b, extras in work:
        at = b.first_run if spec.first_run else b.steps
        per_tensor = extras[at] if at >= 0 else None
        found_inf = extras[b.flag] if b.flag >= 0 else None
        div_t = divisor_tensor.to(lists[0][0].device) if divisor_tensor is not None else None
        call_operator(
            spec, group, lists, per_tensor, divisor if div_t is None else 1.0, div_t, found_inf, kernel_check
        )
    for flag, count in flags.values():
        count.add_(flag.ne(0).to(torch.float32))
        opt._skips.last_flags.append(flag)
    return loss
