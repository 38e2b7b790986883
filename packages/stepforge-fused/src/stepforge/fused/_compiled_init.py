# SPDX-License-Identifier: Apache-2.0
"""``_init_group`` of the fused optimizers: the state and tensor lists of one param group for a compiled step.

``torch.compile`` (dynamo) runs an optimizer's ``_init_group(group, <empty lists>...)`` eagerly while it traces
``step()``, puts the tensors the lists then hold into the graph as inputs (parameters and state as static
addresses, guarded) and takes its return value as a constant. So everything a compiled step must not trace
happens here, once per compilation: argument checks, state creation (the same ``_init_state`` as the eager step),
the grouping into kernel buckets, and the tensors the graph mutates besides the state lists (each bucket's step
counts as one flat tensor, skip flags). The return value says where each bucket lies in the lists
(:data:`BucketPlan`).

Steps are laid out as the eager step lays them out: one float32 ``(n,)`` tensor per bucket whose elements *are*
``state[p]["step"]`` (0-dim views). The graph takes that tensor (one input, one operator argument) instead of n
0-dim inputs, and the state sees every update through the views.
"""

from __future__ import annotations

from typing import Any

import torch

from ._bucket_cache import device_steps
from ._distributed import is_dtensor
from ._validate import check_pair

__all__ = ["BucketPlan", "init_group"]

#: ``(start, stop, masters_start, masters_stop, device, flag_index, count_index, first_run_index, steps_index)``
#: of one bucket: its slice of the params/grads/state lists, its slice of the masters list, its device as a
#: string, and indices into the ``extras`` list (``-1``: none) of its device's skip flag and skip counter
#: (float32 ``(1,)``, when the step checks for inf/NaN), of its SGD first-run flags (CPU int64 ``(n,)``) and of
#: its step counts (float32 ``(n,)``, whose elements are the state's ``step`` tensors).
BucketPlan = tuple[int, int, int, int, str, int, int, int, int]


def _refuse_unsupported(opt: Any, group: dict[str, Any]) -> None:
    owner = opt._owner
    amp = opt.__dict__
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


def _bucket_steps(states: list[dict[str, Any]], device: torch.device) -> torch.Tensor:
    """One float32 ``(n,)`` tensor on ``device`` holding the bucket's steps, its elements put back into the
    states as 0-dim views (the eager step's tensor is kept when the states already view it in order)."""
    flat = device_steps([st["step"] for st in states], device)
    for j, st in enumerate(states):
        st["step"] = flat[j]
    return flat


def init_group(
    opt: Any,
    group: dict[str, Any],
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    state_a: list[torch.Tensor],
    state_b: list[torch.Tensor],
    masters: list[torch.Tensor],
    extras: list[torch.Tensor],
) -> tuple[BucketPlan, ...]:
    """Fill the lists with ``group``'s parameters that have a gradient, bucket by bucket, and return the plan
    (``opt``: the :class:`~._base.FusedOptimizerBase`, which imports this module).

    ``state_a``/``state_b`` get the optimizer's state tensors in ``_state_keys(group)`` order (``exp_avg``,
    ``exp_avg_sq``; or ``momentum_buffer``), ``masters`` the float32 masters of master-weight buckets, ``extras``
    the steps and flag tensors of the plan.
    """
    owner = opt._owner
    _refuse_unsupported(opt, group)
    keys = opt._state_keys(group)
    check = opt.skip_nonfinite if opt.skip_nonfinite is not None else opt.master_weights
    staged: dict[tuple[Any, ...], list[tuple[torch.Tensor, torch.Tensor, dict[str, Any], bool]]] = {}
    for i, p in enumerate(group["params"]):
        g = p.grad
        if g is None:
            continue
        check_pair(p, g, i, owner=owner)
        if group.get("capturable", False) and not opt._device_path(p.device):
            raise RuntimeError(
                f"{owner}: capturable=True needs CUDA parameters, but parameter #{i} is on {p.device}; pass "
                "capturable=False for CPU parameters (torch.optim raises for capturable=True on CPU too)."
            )
        state, fresh = opt._init_state(p, group)
        master = opt.master_weights and p.dtype != torch.float32
        staged.setdefault((p.device, p.dtype, g.dtype, master), []).append((p, g, state, fresh))
    opt._compile_first_run.pop(id(group), None)
    plan: list[BucketPlan] = []
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
            steps = extra(_bucket_steps([e[2] for e in entries], device))
        if check:
            skips = opt._skips
            flag = extra(skips.device_flag(device, None))
            count = extra(skips.counts.setdefault(device, torch.zeros(1, dtype=torch.float32, device=device)))
        if any(e[3] for e in entries) and "momentum_buffer" in keys:
            # SGD: buffers created now take the gradient itself on the first compiled run (torch's first step)
            flags = torch.tensor([int(e[3]) for e in entries], dtype=torch.int64)
            opt._compile_first_run.setdefault(id(group), []).append(flags)  # kept alive: the graph reads it
            first = extra(flags)
        plan.append((start, len(params), m_start, len(masters), str(device), flag, count, first, steps))
    # the eager step's buckets may hold step tensors replaced above: they are rebuilt at the next eager step
    opt._bucket_cache.invalidate()
    return tuple(plan)
