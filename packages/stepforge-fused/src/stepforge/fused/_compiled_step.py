# SPDX-License-Identifier: Apache-2.0
"""The step of the fused optimizers under ``torch.compile``: what dynamo traces when it meets ``step()``.

``step()`` checks :func:`torch.compiler.is_compiling` first: eagerly it takes the cached-pointer path
(:mod:`._host_step`, :mod:`._device_step`), under dynamo it takes :func:`traced_step`, which dynamo turns into
one graph without breaks: ``_init_group`` (:mod:`._compiled_init`, run eagerly by dynamo) gives the tensor
lists and the bucket plan; the graph holds the inf/NaN pre-check and LAMB's global clip as tensor ops and one
``stepforge_fused`` operator call per bucket (:mod:`._ops`), which inductor runs in place on the parameters and
state. Same kernels, same scalars and the same decisions as the eager step, so the results are bit-identical.

A ``torch.Tensor`` learning rate (and the per-parameter ``step`` tensors) are read by the graph, so an LR
scheduler that writes the tensor in place (``LRScheduler`` does for tensor lrs) never recompiles it; a float lr
is a constant of the graph (dynamo recompiles when it changes, as it does for torch.optim).

Without the operators (a torch lacking ``torch.library.register_fake``, see :func:`._ops.available`) the step runs
eagerly inside the compiled code: a graph break, announced by one warning (``fullgraph=True`` then raises
dynamo's error, since the step cannot be part of the graph).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from . import _ops

__all__ = ["lr_args", "prepare_fallback", "traced_step"]

_warned: set[str] = set()


def _announce_fallback(owner: str) -> None:
    if owner in _warned:
        return
    _warned.add(owner)
    warnings.warn(
        f"stepforge-fused: torch.compile runs {owner}.step() eagerly (a graph break), because "
        f"{_ops.unavailable_reason()}.",
        RuntimeWarning,
        stacklevel=3,
    )


def _eager(opt: Any, closure: Any, div_scale: float) -> Any:
    _announce_fallback(opt._owner)
    with torch.no_grad():
        return opt._eager_step(closure, div_scale)


#: The eager step behind ``torch.compiler.disable`` (dynamo does not trace it: the compiled code breaks there and
#: calls it), made by :func:`prepare_fallback` outside tracing and only without the operators: creating it imports
#: torch._dynamo (about a second), which an ``import stepforge.fused`` must not cost.
_fallback: list[Callable[[Any, Any, float], Any]] = []


def prepare_fallback() -> None:
    """Called when an optimizer is built: without the operators, prepare the eager step compiled code calls."""
    if not _ops.available() and not _fallback:
        _fallback.append(torch.compiler.disable(_eager))


def _combined(flags: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``any`` of 0-dim bool tensors that may live on several devices, on ``device``."""
    return torch.stack([f.to(device) for f in flags]).any()


def traced_step(opt: Any, closure: Any, div_scale: float) -> Any:
    """The compiled step (traced by dynamo; see the module docstring)."""
    if not _ops.available():
        return _fallback[0](opt, closure, div_scale)
    divisor = opt._amp.divisor(opt, div_scale)
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
        for bucket in plan:
            start, stop, m_start, m_stop = bucket[0], bucket[1], bucket[2], bucket[3]
            lists = (
                params[start:stop],
                grads[start:stop],
                state_a[start:stop],
                state_b[start:stop],
                masters[m_start:m_stop],
                extras[bucket[8]] if bucket[8] >= 0 else None,
            )
            work.append((group, lists, bucket, extras))
    if not work:
        return loss
    check = opt.skip_nonfinite if opt.skip_nonfinite is not None else opt.master_weights
    clip = opt._device_clip_norm()
    flags: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for _group, _lists, bucket, extras in work:
        if bucket[5] >= 0:
            flags[bucket[4]] = (extras[bucket[5]], extras[bucket[6]])
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
        bad = _combined([~torch.isfinite(n / divisor) for n in norms], home)
        for flag, _count in flags.values():
            flag.copy_(bad.to(device=flag.device, dtype=torch.float32).reshape(1))
    divisor_tensor: torch.Tensor | None = None
    if clip > 0:
        # LAMB's global clip, in the eager step's order: total = sum ||g_b||^2, c = max(1, sqrt(total)/div/max)
        home = norms[0].device
        total = norms[0].to(home) * norms[0].to(home)
        for n in norms[1:]:
            total = total + n.to(home) * n.to(home)
        global_norm = torch.sqrt(total) / divisor
        clipped = torch.isfinite(global_norm) & (global_norm > clip)
        divisor_tensor = divisor * torch.where(clipped, global_norm / clip, torch.ones_like(global_norm))
    for group, lists, bucket, extras in work:
        found_inf = extras[bucket[5]] if bucket[5] >= 0 else None
        first_run = extras[bucket[7]] if bucket[7] >= 0 else None
        div_t = divisor_tensor.to(lists[0][0].device) if divisor_tensor is not None else None
        opt._op_launch(
            group, lists, divisor if div_t is None else 1.0, div_t, found_inf, kernel_check, first_run
        )
    for flag, count in flags.values():
        count.add_(flag.ne(0).to(torch.float32))
        opt._skips.last_flags.append(flag)
    return loss


def lr_args(group: dict[str, Any]) -> tuple[float, torch.Tensor | None]:
    """``(lr, lr_tensor)`` of an operator call: a tensor lr is read by the graph (no recompile when it changes),
    a float lr is a constant of the graph."""
    lr = group["lr"]
    if isinstance(lr, torch.Tensor):
        return 0.0, lr
    return float(lr), None
