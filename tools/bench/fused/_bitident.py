# SPDX-License-Identifier: Apache-2.0
"""The ``bitident`` case of ``bench_fused_cpu.py``: the fused optimizers against their references, ``torch.equal``."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch

from bench.fused._parts import HP, import_lamb

__all__ = ["bit_identity"]


def bit_identity(
    args: argparse.Namespace, fused: Any, err: str | None, steps: int = 5
) -> list[dict[str, Any]]:
    """Run ``steps`` steps of each optimizer and of its reference from the same start with the same per-step
    gradients, then compare params and state tensors.

    ``CPUAdam``/``FusedAdam`` are held to ``torch.equal`` against ``AdamW(fused=True)``; ``FusedSGD`` against
    torch's for-loop ``SGD(foreach=False)``, the operation order it follows (``SGD(fused=True)``'s scalar tail
    contracts ``buf*m + g*(1-dampening)`` into one fma, so on sizes off its 64-element body it may differ by an
    ulp: shown beside, not expected equal); ``FusedLAMB`` against ``Lamb.fused_lamb`` (a different summation
    order in the norms, so ``max_rel_diff`` is the figure there). ``bit_identity_expected`` says which.
    """
    sizes = [1, 7, 16, 33, 1000, 4099, 65_537, 1_000_003]  # odd sizes hit every SIMD tail
    gen = torch.Generator().manual_seed(args.seed + 1)
    init = [torch.randn(n, generator=gen) for n in sizes]
    grads = [[torch.randn(n, generator=gen) * 1e-2 for n in sizes] for _ in range(steps)]
    Make = Callable[[list[torch.Tensor]], torch.optim.Optimizer]

    def run(make: Make) -> tuple[list[torch.Tensor], list[dict]]:
        params = [torch.nn.Parameter(t.clone()) for t in init]
        opt = make(params)
        for k in range(steps):
            for p, g in zip(params, grads[k], strict=True):
                p.grad = g.clone()
            opt.step()
        return [p.detach() for p in params], [opt.state[p] for p in params]

    adam_ref = ("AdamW(fused=True)", lambda ps: torch.optim.AdamW(ps, fused=True, **HP))
    sgd_hp = dict(lr=0.01, momentum=0.9, weight_decay=1e-4)
    sgd_ref = ("SGD(foreach=False)", lambda ps: torch.optim.SGD(ps, foreach=False, **sgd_hp))
    sgd_fused = ("SGD(fused=True)", lambda ps: torch.optim.SGD(ps, fused=True, **sgd_hp))
    lamb_hp = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01)
    Lamb, lamb_err = import_lamb()
    lamb_ref = ("Lamb.fused_lamb", (lambda ps: Lamb.fused_lamb(ps, **lamb_hp)) if Lamb is not None else None)
    # (name, make, (ref name, ref make), state keys, bit identity expected)
    checks: list[tuple[str, Make | None, tuple[str, Make | None], tuple[str, ...], bool]] = [
        ("CPUAdam", None, adam_ref, ("exp_avg", "exp_avg_sq"), True),
        ("FusedAdam", None, adam_ref, ("exp_avg", "exp_avg_sq"), True),
        ("FusedSGD", None, sgd_ref, ("momentum_buffer",), True),
        ("FusedSGD", None, sgd_fused, ("momentum_buffer",), False),
        ("FusedLAMB", None, lamb_ref, ("exp_avg", "exp_avg_sq"), False),
        (
            "AdamW(foreach=False) [torch's for-loop, for scale]",
            lambda ps: torch.optim.AdamW(ps, foreach=False, **HP),
            adam_ref,
            ("exp_avg", "exp_avg_sq"),
            False,
        ),
    ]
    if fused is not None:
        makers: dict[str, Make] = {
            "CPUAdam": lambda ps: fused.CPUAdam(ps, adamw_mode=True, **HP),
            "FusedAdam": lambda ps: fused.FusedAdam(ps, adamw_mode=True, **HP),
            "FusedSGD": lambda ps: fused.FusedSGD(ps, **sgd_hp),
            "FusedLAMB": lambda ps: fused.FusedLAMB(ps, **lamb_hp),
        }
        checks = [(n, makers.get(n, m), r, k, e) for n, m, r, k, e in checks]
    refs: dict[str, tuple[list[torch.Tensor], list[dict]]] = {}
    out = []
    for name, make, (ref_name, ref_make), keys, expected in checks:
        entry: dict[str, Any] = {"optimizer": name, "reference": ref_name, "bit_identity_expected": expected}
        if make is None or ref_make is None:
            entry |= {"equal": None, "error": err if make is None else lamb_err}
            out.append(entry)
            continue
        try:
            if ref_name not in refs:
                refs[ref_name] = run(ref_make)
            ref_p, ref_s = refs[ref_name]
            got_p, got_s = run(make)
        except Exception as exc:
            out.append(entry | {"equal": None, "error": f"{type(exc).__name__}: {exc}"})
            continue
        pairs = [("param", a, b) for a, b in zip(got_p, ref_p, strict=True)]
        for key in keys:
            pairs += [(key, sa.get(key), sb.get(key)) for sa, sb in zip(got_s, ref_s, strict=True)]
        present = [
            (k, a, b) for k, a, b in pairs if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        ]
        missing = sorted(
            {k for k, a, b in pairs if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor))}
        )
        max_rel = max(
            float(((a.double() - b.double()).abs() / b.double().abs().clamp_min(1e-30)).max())
            for _, a, b in present
        )
        entry |= {
            "equal": not missing and all(torch.equal(a, b) for _, a, b in present),
            "mismatched_elements": sum(int((a != b).sum()) for _, a, b in present),
            "compared_elements": sum(a.numel() for _, a, _ in present),
            "max_abs_diff": max(float((a.double() - b.double()).abs().max()) for _, a, b in present),
            "max_rel_diff": max_rel,
            "missing_state": missing,
            "steps": steps,
            "sizes": sizes,
        }
        out.append(entry)
    return out
