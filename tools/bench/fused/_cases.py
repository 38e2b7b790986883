# SPDX-License-Identifier: Apache-2.0
"""The timed case groups of ``bench_fused_cpu.py``: ``adam``, ``mixed``, ``lamb``, ``sgd``, ``fusedadam``."""

from __future__ import annotations

import argparse
import gc
from typing import Any

import torch

from bench.fused._parts import (
    HP,
    Sizes,
    case_label,
    compare,
    import_lamb,
    make_bundle,
    master_values,
    print_row,
    try_build,
)

__all__ = ["adam_cases", "fusedadam_cases", "lamb_cases", "mixed_cases", "sgd_cases"]


def adam_cases(args: argparse.Namespace, sizes: Sizes, ceiling: float, fused: Any, err: str | None):
    rows = []
    shapes = [
        # targets: >= 0.98x at the memory ceiling on one big tensor, >= 3x on 2 000 x 10k, >= 10x on 20 000 x 1k
        ((1, sizes.big), 0.98, 90.0, ("reuse",), True),
        (sizes.medium, 3.0, None, ("reuse", "fresh"), False),
        (sizes.small, 10.0, None, ("reuse", "fresh"), False),
    ]
    for (count, numel), target, pct, modes, with_foreach in shapes:
        init, grad = master_values(count, numel, args.seed)
        for mode in modes:
            fresh = mode == "fresh"

            def ours_build(
                fresh: bool = fresh,
                count: int = count,
                numel: int = numel,
                init: torch.Tensor = init,
                grad: torch.Tensor = grad,
            ):
                if fused is None:
                    raise RuntimeError(err)
                b = make_bundle(init, grad, count, numel, dtype=torch.float32, fresh=fresh)
                opt = fused.CPUAdam(b.params, bias_correction=True, adamw_mode=True, **HP)
                return opt.step, b

            def torch_build(
                flag: str,
                fresh: bool = fresh,
                count: int = count,
                numel: int = numel,
                init: torch.Tensor = init,
                grad: torch.Tensor = grad,
            ):
                b = make_bundle(init, grad, count, numel, dtype=torch.float32, fresh=fresh)
                opt = torch.optim.AdamW(b.params, **HP, **{flag: True})
                return opt.step, b

            ours = try_build("CPUAdam", ours_build)
            if ours.error and err is None:
                ours.error = f"CPUAdam failed: {ours.error}"
            fused_c = try_build("AdamW(fused)", lambda: torch_build("fused"))
            label = case_label(count, numel)
            rows.append(
                compare(
                    case=f"CPUAdam vs AdamW(fused) {label}",
                    group="adam",
                    ours=ours,
                    baselines=[fused_c],
                    elements=count * numel,
                    tensors=count,
                    grads=mode,
                    target=target,
                    target_pct=pct,
                    ceiling=ceiling,
                    args=args,
                )
            )
            print_row(rows[-1])
            if with_foreach:
                fused_c = None
                gc.collect()
                foreach_c = try_build("AdamW(foreach)", lambda: torch_build("foreach"))
                rows.append(
                    compare(
                        case=f"CPUAdam vs AdamW(foreach) {label}",
                        group="adam",
                        ours=ours,
                        baselines=[foreach_c],
                        elements=count * numel,
                        tensors=count,
                        grads=mode,
                        target=1.0,
                        target_pct=None,
                        ceiling=ceiling,
                        args=args,
                    )
                )
                print_row(rows[-1])
                foreach_c = None
            ours = fused_c = None
            gc.collect()
        init = grad = None
        gc.collect()
    return rows


def mixed_cases(args: argparse.Namespace, sizes: Sizes, ceiling: float, fused: Any, err: str | None):
    rows = []
    for (count, numel), target in (((1, sizes.big), 1.5), (sizes.medium, 3.0)):
        init, grad = master_values(count, numel, args.seed)

        def ours_build(
            count: int = count, numel: int = numel, init: torch.Tensor = init, grad: torch.Tensor = grad
        ):
            if fused is None:
                raise RuntimeError(err)
            b = make_bundle(init, grad, count, numel, dtype=torch.bfloat16, fresh=False)
            opt = fused.CPUAdam(b.params, bias_correction=True, adamw_mode=True, master_weights=True, **HP)
            return opt.step, b

        def torch_build(
            foreach_copy: bool,
            count: int = count,
            numel: int = numel,
            init: torch.Tensor = init,
            grad: torch.Tensor = grad,
        ):
            b = make_bundle(init, grad, count, numel, dtype=torch.bfloat16, fresh=False)
            masters = [p.detach().float() for p in b.params]
            for m in masters:
                m.grad = torch.empty_like(m)
            opt = torch.optim.AdamW(masters, fused=True, **HP)
            params = [p.detach() for p in b.params]
            grads = [p.grad for p in b.params]
            mgrads = [m.grad for m in masters]

            if foreach_copy:

                def step() -> None:
                    torch._foreach_copy_(mgrads, grads)
                    opt.step()
                    torch._foreach_copy_(params, masters)
            else:

                def step() -> None:
                    for mg, g in zip(mgrads, grads, strict=True):
                        mg.copy_(g)
                    opt.step()
                    for p, m in zip(params, masters, strict=True):
                        p.copy_(m)

            b.extra["masters"] = masters
            return step, b

        ours = try_build("CPUAdam(master_weights)", ours_build)
        b_loop = try_build("copy+AdamW(fused)+copy", lambda: torch_build(False))
        b_each = try_build("foreach_copy+AdamW(fused)+foreach_copy", lambda: torch_build(True))
        rows.append(
            compare(
                case=f"CPUAdam bf16+fp32 master vs copy/AdamW(fused)/copy {case_label(count, numel)}",
                group="mixed",
                ours=ours,
                baselines=[b_loop, b_each],
                elements=count * numel,
                tensors=count,
                grads="reuse",
                target=target,
                target_pct=None,
                ceiling=ceiling,
                args=args,
                note="baseline = the faster of a per-tensor copy_ loop and torch._foreach_copy_",
            )
        )
        print_row(rows[-1])
        ours = b_loop = b_each = init = grad = None
        gc.collect()
    return rows


def lamb_cases(args: argparse.Namespace, sizes: Sizes, ceiling: float, fused: Any, err: str | None):
    Lamb, lamb_err = import_lamb()
    count, numel = sizes.medium
    init, grad = master_values(count, numel, args.seed)
    lamb_hp = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01)

    def ours_build(init: torch.Tensor = init, grad: torch.Tensor = grad):
        if fused is None:
            raise RuntimeError(err)
        b = make_bundle(init, grad, count, numel, dtype=torch.float32, fresh=False)
        return fused.FusedLAMB(b.params, **lamb_hp).step, b

    def ref_build(init: torch.Tensor = init, grad: torch.Tensor = grad):
        if Lamb is None:
            raise RuntimeError(lamb_err)
        b = make_bundle(init, grad, count, numel, dtype=torch.float32, fresh=False)
        # the same math as FusedLAMB: apex defaults (bias correction on the update, no ratio without decay,
        # global grad-norm clipping at 1.0)
        make = getattr(Lamb, "fused_lamb", None)
        if make is not None:
            return make(b.params, **lamb_hp).step, b
        return Lamb(b.params, bias_correction=True, max_grad_norm=1.0, **lamb_hp).step, b

    ours = try_build("FusedLAMB", ours_build)
    ref = try_build("stepforge.optim.Lamb", ref_build)
    row = compare(
        case=f"FusedLAMB vs Lamb.fused_lamb {case_label(count, numel)}",
        group="lamb",
        ours=ours,
        baselines=[ref],
        elements=count * numel,
        tensors=count,
        grads="reuse",
        target=5.0,
        target_pct=None,
        ceiling=ceiling,
        args=args,
        note="same math: FusedLAMB defaults vs Lamb.fused_lamb (bias correction, grad averaging, max_grad_norm=1.0)",
    )
    if ref.error:
        row["baseline_error"] = ref.error
    print_row(row)
    return [row]


def _against_torch_fused(
    args: argparse.Namespace,
    sizes: Sizes,
    ceiling: float,
    err: str | None,
    ours: tuple[str, Any],
    torch_ref: tuple[str, Any],
    group: str,
    note: str | None = None,
):
    """One stepforge optimizer against torch's fused one on the big tensor and the medium list: ``ours`` and
    ``torch_ref`` are ``(label, params -> optimizer)`` (``ours``'s factory ``None``: stepforge-fused is missing,
    ``err`` says why)."""
    (ours_name, make_ours), (ref_name, make_ref) = ours, torch_ref
    rows = []
    for count, numel in ((1, sizes.big), sizes.medium):
        init, grad = master_values(count, numel, args.seed)

        def build(
            make: Any,
            count: int = count,
            numel: int = numel,
            init: torch.Tensor = init,
            grad: torch.Tensor = grad,
        ):
            if make is None:
                raise RuntimeError(err)
            b = make_bundle(init, grad, count, numel, dtype=torch.float32, fresh=False)
            return make(b.params).step, b

        mine = try_build(ours_name, lambda: build(make_ours))
        ref = try_build(ref_name, lambda: build(make_ref))
        extra = {"note": note} if note is not None else {}
        rows.append(
            compare(
                case=f"{ours_name} vs {ref_name} {case_label(count, numel)}",
                group=group,
                ours=mine,
                baselines=[ref],
                elements=count * numel,
                tensors=count,
                grads="reuse",
                target=1.0,
                target_pct=None,
                ceiling=ceiling,
                args=args,
                **extra,
            )
        )
        print_row(rows[-1])
        mine = ref = init = grad = None
        gc.collect()
    return rows


def sgd_cases(args: argparse.Namespace, sizes: Sizes, ceiling: float, fused: Any, err: str | None):
    sgd_hp = dict(lr=0.01, momentum=0.9, weight_decay=1e-4)
    ours = None if fused is None else (lambda ps: fused.FusedSGD(ps, **sgd_hp))
    ref = lambda ps: torch.optim.SGD(ps, fused=True, **sgd_hp)  # noqa: E731
    note = "momentum 0.9, weight_decay 1e-4"
    return _against_torch_fused(
        args, sizes, ceiling, err, ("FusedSGD", ours), ("SGD(fused)", ref), group="sgd", note=note
    )


def fusedadam_cases(args: argparse.Namespace, sizes: Sizes, ceiling: float, fused: Any, err: str | None):
    ours = (
        None
        if fused is None
        else (lambda ps: fused.FusedAdam(ps, bias_correction=True, adamw_mode=True, **HP))
    )
    ref = lambda ps: torch.optim.AdamW(ps, fused=True, **HP)  # noqa: E731
    return _against_torch_fused(
        args, sizes, ceiling, err, ("FusedAdam", ours), ("AdamW(fused)", ref), group="adam"
    )
