# SPDX-License-Identifier: Apache-2.0
"""Helpers for the tests of compiled optimizer steps (``torch.compile(opt.step)``): side-by-side runs against
the eager step, an ulp distance, and the peak of transient allocations measured from the allocator's records.

torch's dynamo counters (graph breaks, unique graphs) are read by the tests themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

__all__ = [
    "compiled_beside_eager",
    "lambda_schedule",
    "peak_transient_bytes",
    "resident_bytes",
    "same_bits",
    "scale_ulps",
    "set_grads",
    "state_tensors",
]


def set_grads(
    groups: Sequence[Sequence[torch.Tensor]], step: int, *, dtype: torch.dtype | None = None
) -> None:
    """Give every parameter of each list the same fresh gradient (new tensors, seeded by ``step``), so two
    optimizers stepping their own copies of the parameters see equal inputs."""
    first = groups[0]
    gen = torch.Generator().manual_seed(10_000 + step)
    values = [torch.randn(p.shape, generator=gen) for p in first]
    for params in groups:
        for p, g in zip(params, values, strict=True):
            p.grad = g.to(device=p.device, dtype=dtype or p.dtype, copy=True)


def state_tensors(opt: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of ``opt.state``, as ``(where, tensor)`` in parameter order (for comparisons)."""
    out = []
    for gi, group in enumerate(opt.param_groups):
        for pi, p in enumerate(group["params"]):
            for key, value in sorted(opt.state.get(p, {}).items()):
                if isinstance(value, torch.Tensor):
                    out.append((f"group {gi} param {pi} state[{key!r}]", value))
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values and dtypes, NaNs at the same places (``torch.equal`` treats NaN as unequal)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.detach().cpu(), b.detach().cpu()
    return bool(torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)) and torch.equal(a.isnan(), b.isnan()))


def scale_ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b|`` in units of the ulp of ``max |a|`` (the spacing of ``a``'s dtype at its largest
    magnitude): the error measure for two computations of the same update that round differently. 0 for
    equal tensors; an all-zero ``a`` compares in absolute units of its dtype's smallest normal."""
    a32, b32 = a.detach().cpu().double(), b.detach().cpu().double()
    info = torch.finfo(a.dtype)
    top = float(a32.abs().max()) if a32.numel() else 0.0
    unit = info.eps * 2.0 ** torch.floor(torch.log2(torch.tensor(top))).item() if top > 0 else info.tiny
    return float((a32 - b32).abs().max()) / unit if a32.numel() else 0.0


def resident_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the parameters, their gradients and every state tensor of ``opt`` (what a step keeps live)."""
    total = 0
    for group in opt.param_groups:
        for p in group["params"]:
            total += p.numel() * p.element_size()
            if p.grad is not None:
                total += p.grad.numel() * p.grad.element_size()
    return total + sum(t.numel() * t.element_size() for _, t in state_tensors(opt))


def peak_transient_bytes(fn: Callable[[], Any]) -> int:
    """The peak of the bytes ``fn`` allocates and has not yet freed, from the CPU allocator's records (torch
    profiler memory events: every CPU tensor allocation, inductor's buffers included)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    )
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def lambda_schedule(optimizers: Iterable[torch.optim.Optimizer], decay: float = 0.9) -> list[Any]:
    """One ``LambdaLR`` (``lr * decay**epoch``) per optimizer: every step changes the learning rate."""
    return [torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: decay**epoch) for opt in optimizers]


def compiled_beside_eager(
    eager: torch.optim.Optimizer,
    compiled: torch.optim.Optimizer,
    eager_params: Sequence[torch.Tensor],
    compiled_params: Sequence[torch.Tensor],
    compare: Callable[[str], None],
    *,
    steps: int = 20,
    check_at: Iterable[int] = (9, 19),
) -> Callable[[], Any]:
    """``torch.compile(compiled.step, fullgraph=True)`` stepped beside ``eager.step`` for ``steps`` steps with
    the same fresh gradients while a :func:`lambda_schedule` changes the learning rate every step (callers run it
    under dynamo's ``error_on_recompile``, so a second compile raises); ``compare(label)`` runs after the steps in
    ``check_at``.
    Then one more set of gradients, and the compiled step's peak allocation is asserted within 1% of the eager
    step's (resident state included). Returns the compiled step; the caller reads dynamo's counters."""
    step = torch.compile(compiled.step, fullgraph=True)
    schedulers = lambda_schedule([eager, compiled])
    compiled._opt_called = True  # type: ignore[attr-defined]  # the scheduler patched opt.step after compiling
    checks = set(check_at)
    for i in range(steps):
        set_grads([eager_params, compiled_params], i)
        eager.step()
        step()
        for s in schedulers:
            s.step()
        if i in checks:
            compare(f"step {i + 1}")
    set_grads([eager_params, compiled_params], steps)
    resident = resident_bytes(compiled)
    eager_peak = peak_transient_bytes(eager.step)
    compiled_peak = peak_transient_bytes(step)
    assert resident + compiled_peak <= 1.01 * (resident + eager_peak), (resident, eager_peak, compiled_peak)
    return step
