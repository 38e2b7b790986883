# SPDX-License-Identifier: Apache-2.0
"""CPU benchmark of stepforge-fused's optimizers against the best torch equivalents, side by side in one run.

    python tools/bench/bench_fused_cpu.py                 # full run (~3-6 min on 2 cores)
    python tools/bench/bench_fused_cpu.py --quick         # smaller sizes, 3 repeats: a smoke run (~30 s)
    python tools/bench/bench_fused_cpu.py --cases adam,bitident --threads 2 --repeats 15 --out bench-out

What it measures (fp32 unless said; every contender gets the same initial values and gradients):

- the memory-bandwidth ceiling of the Adam access pattern (4 reads + 3 in-place writes, trivial math) and a
  STREAM-like triad, so each kernel's effective GB/s can be read as a fraction of what the machine can move;
- ``adam``: ``CPUAdam`` vs ``torch.optim.AdamW(fused=True)`` (and ``foreach=True``) on one 50M-element tensor,
  on 2 000 x 10 000 and on 20 000 x 1 000 tensors;
- ``mixed``: bf16 params and grads with fp32 masters, ``CPUAdam(master_weights=True)`` vs the best torch
  composition (copy the bf16 grad into an fp32 master grad, fused AdamW on the masters, copy back to bf16);
- ``lamb``: ``FusedLAMB`` vs the pure-Python ``stepforge.optim.Lamb``;
- ``sgd``: ``FusedSGD`` (momentum 0.9) vs ``torch.optim.SGD(fused=True)``;
- ``fusedadam``: ``FusedAdam`` vs ``torch.optim.AdamW(fused=True)``;
- ``bitident``: ``FusedAdam``/``CPUAdam`` vs ``torch.optim.AdamW(fused=True)`` after a few steps, ``torch.equal``.

Gradients. The headline rows reuse the same ``p.grad`` tensors every step, refreshed in place -- what a loop with
``zero_grad(set_to_none=False)`` or gradients living in a DDP/ZeRO bucket has. Rows marked ``fresh`` hand the
optimizer a different set of gradient tensors (other objects at other addresses) on every step, as
``zero_grad(set_to_none=True)`` + ``backward()`` does; this catches a kernel whose pointer cache only pays off
when nothing changes. Creating those tensors is not timed.

Only ``optimizer.step()`` is timed: contenders run round-robin, median of ``--repeats`` after ``--warmup`` steps.
Effective GB/s = minimum bytes an ideal kernel moves / time (Adam fp32: 28 B per element; see README.md).
Results: a table on stdout, ``<out>/<stem>.json`` and ``<out>/<stem>.png``.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common

__all__ = ["main"]

CASE_GROUPS = ("adam", "mixed", "lamb", "sgd", "fusedadam", "bitident")
HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)

# Minimum bytes per element an ideal single-pass kernel moves (reads + writes), for effective GB/s.
BYTES = {
    "adam": 28,  # read p, g, m, v (fp32); write p, m, v
    "mixed": 28,  # read g (bf16 2) + master, m, v (12); write master, m, v (12) + bf16 param (2)
    "sgd": 20,  # read p, g, momentum buffer; write p, buffer
    "lamb": 44,  # grad-norm pass reads g (4); stage 1 reads p, g, m, v writes m, v (24); stage 2 p, m, v -> p (16)
}


@dataclass
class Sizes:
    big: int
    medium: tuple[int, int]
    small: tuple[int, int]
    ceiling: int


FULL = Sizes(big=50_000_000, medium=(2_000, 10_000), small=(20_000, 1_000), ceiling=50_000_000)
QUICK = Sizes(big=4_000_000, medium=(200, 10_000), small=(2_000, 1_000), ceiling=8_000_000)


def _label(count: int, numel: int) -> str:
    def short(n: int) -> str:
        for unit, div in (("M", 1_000_000), ("k", 1_000)):
            if n % div == 0 and n >= div:
                return f"{n // div}{unit}"
        return str(n)

    return f"{count}x{short(numel)}"


# --------------------------------------------------------------------------------------------------------
# the code under test, imported lazily so the torch baselines still run before stepforge-fused is installed
# --------------------------------------------------------------------------------------------------------
def _import_fused() -> tuple[Any, str | None]:
    try:
        import stepforge.fused as fused
    except Exception as exc:  # ImportError, or an extension that fails to load
        return None, f"stepforge.fused is not importable ({type(exc).__name__}: {exc})"
    return fused, None


def _import_lamb() -> tuple[Any, str | None]:
    try:
        from stepforge.optim import Lamb
    except Exception as exc:
        return None, f"stepforge.optim.Lamb is not importable ({type(exc).__name__}: {exc})"
    return Lamb, None


# --------------------------------------------------------------------------------------------------------
# tensors
# --------------------------------------------------------------------------------------------------------
@dataclass
class Bundle:
    """One contender's parameters and its gradient sets (set 0 always; set 1 too in ``fresh`` mode)."""

    params: list[torch.Tensor]
    grad_sets: list[list[torch.Tensor]]
    flip: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def attach(self, k: int = 0) -> None:
        for p, g in zip(self.params, self.grad_sets[k], strict=True):
            p.grad = g

    def next_grads(self) -> None:
        """Hand the optimizer the other gradient set (different tensors at different addresses)."""
        self.flip ^= 1
        self.attach(self.flip)


def _master_values(count: int, numel: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    init = torch.randn(count * numel, generator=gen)
    grad = torch.randn(count * numel, generator=gen) * 1e-2
    return init, grad


def make_bundle(
    init: torch.Tensor, grad: torch.Tensor, count: int, numel: int, *, dtype: torch.dtype, fresh: bool
) -> Bundle:
    """Separate tensors (own storage each, like a model's parameters) holding the shared values."""

    def split(src: torch.Tensor) -> list[torch.Tensor]:
        if count == 1:
            return [src.to(dtype, copy=True)]
        return [t.to(dtype, copy=True) for t in src.split(numel)]

    params = [torch.nn.Parameter(t) for t in split(init)]
    grad_sets = [split(grad)]
    if fresh:
        grad_sets.append(split(grad))
    b = Bundle(params, grad_sets)
    b.attach(0)
    return b


# --------------------------------------------------------------------------------------------------------
# one comparison
# --------------------------------------------------------------------------------------------------------
@dataclass
class Contender:
    name: str
    step: Callable[[], Any] | None  # None: unavailable (see error)
    bundle: Bundle | None = None
    error: str | None = None


def compare(
    *,
    case: str,
    group: str,
    ours: Contender,
    baselines: list[Contender],
    elements: int,
    tensors: int,
    grads: str,
    target: float | None,
    target_pct: float | None,
    ceiling: float | None,
    args: argparse.Namespace,
    note: str = "",
) -> dict[str, Any]:
    """Time ``ours`` and every baseline round-robin; the fastest baseline is the reference."""
    contenders = [c for c in [ours, *baselines] if c.step is not None]
    before = {c.name: c.bundle.next_grads for c in contenders if grads == "fresh" and c.bundle is not None}
    timings = _common.time_interleaved(
        {c.name: c.step for c in contenders}, warmup=args.warmup, repeats=args.repeats, before=before
    )
    nbytes = BYTES[group] * elements
    base_ms = {c.name: timings[c.name].median_ms for c in baselines if c.name in timings}
    best_base = min(base_ms, key=base_ms.__getitem__) if base_ms else None
    row: dict[str, Any] = {
        "case": case,
        "group": group,
        "grads": grads,
        "ours": ours.name,
        "baseline": best_base,
        "elements": elements,
        "tensors": tensors,
        "bytes_per_element": BYTES[group],
        "target": target,
        "target_pct_of_ceiling": target_pct,
        "timings": {name: t.to_dict() for name, t in timings.items()},
        "note": note,
    }
    ours_ms = timings[ours.name].median_ms if ours.name in timings else None
    torch_ms = base_ms.get(best_base) if best_base else None
    row["ours_ms"] = ours_ms
    row["torch_ms"] = torch_ms
    row["ratio"] = torch_ms / ours_ms if ours_ms and torch_ms else None
    # best-of-repeats ratio: on a loaded machine the fastest step is the least disturbed one
    if ours_ms and torch_ms:
        row["ratio_min"] = timings[best_base].min_ms / timings[ours.name].min_ms
    else:
        row["ratio_min"] = None
    row["gb_per_s"] = nbytes / (ours_ms * 1e-3) / 1e9 if ours_ms else None
    row["baseline_gb_per_s"] = nbytes / (torch_ms * 1e-3) / 1e9 if torch_ms else None
    if ours.error:
        row["error"] = ours.error
    _apply_ceiling(row, ceiling)
    return row


def _apply_ceiling(row: dict[str, Any], ceiling: float | None) -> None:
    """Set ``pct_of_ceiling`` and ``met`` of ``row`` for the Adam-pattern ``ceiling`` in GB/s."""
    row["pct_of_ceiling"] = 100.0 * row["gb_per_s"] / ceiling if row["gb_per_s"] and ceiling else None
    target, target_pct = row["target"], row["target_pct_of_ceiling"]
    if row["ratio"] is None or target is None:
        row["met"] = None
    else:
        row["met"] = row["ratio"] >= target and (
            target_pct is None or (row["pct_of_ceiling"] is not None and row["pct_of_ceiling"] >= target_pct)
        )


def _try(name: str, build: Callable[[], tuple[Callable[[], Any], Bundle]]) -> Contender:
    try:
        step, bundle = build()
    except Exception as exc:
        return Contender(name, None, error=f"{type(exc).__name__}: {exc}")
    return Contender(name, step, bundle)


# --------------------------------------------------------------------------------------------------------
# case groups
# --------------------------------------------------------------------------------------------------------
def adam_cases(args: argparse.Namespace, sizes: Sizes, ceiling: float, fused: Any, err: str | None):
    rows = []
    shapes = [
        ((1, sizes.big), 1.0, 90.0, ("reuse",), True),
        (sizes.medium, 2.5, None, ("reuse", "fresh"), False),
        (sizes.small, 10.0, None, ("reuse", "fresh"), False),
    ]
    for (count, numel), target, pct, modes, with_foreach in shapes:
        init, grad = _master_values(count, numel, args.seed)
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

            ours = _try("CPUAdam", ours_build)
            if ours.error and err is None:
                ours.error = f"CPUAdam failed: {ours.error}"
            fused_c = _try("AdamW(fused)", lambda: torch_build("fused"))
            label = _label(count, numel)
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
            _print_row(rows[-1])
            if with_foreach:
                fused_c = None
                gc.collect()
                foreach_c = _try("AdamW(foreach)", lambda: torch_build("foreach"))
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
                _print_row(rows[-1])
                foreach_c = None
            ours = fused_c = None
            gc.collect()
        init = grad = None
        gc.collect()
    return rows


def mixed_cases(args: argparse.Namespace, sizes: Sizes, ceiling: float, fused: Any, err: str | None):
    rows = []
    for (count, numel), target in (((1, sizes.big), 1.5), (sizes.medium, 3.0)):
        init, grad = _master_values(count, numel, args.seed)

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

        ours = _try("CPUAdam(master_weights)", ours_build)
        b_loop = _try("copy+AdamW(fused)+copy", lambda: torch_build(False))
        b_each = _try("foreach_copy+AdamW(fused)+foreach_copy", lambda: torch_build(True))
        rows.append(
            compare(
                case=f"CPUAdam bf16+fp32 master vs copy/AdamW(fused)/copy {_label(count, numel)}",
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
        _print_row(rows[-1])
        ours = b_loop = b_each = init = grad = None
        gc.collect()
    return rows


def lamb_cases(args: argparse.Namespace, sizes: Sizes, ceiling: float, fused: Any, err: str | None):
    Lamb, lamb_err = _import_lamb()
    count, numel = sizes.medium
    init, grad = _master_values(count, numel, args.seed)
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

    ours = _try("FusedLAMB", ours_build)
    ref = _try("stepforge.optim.Lamb", ref_build)
    row = compare(
        case=f"FusedLAMB vs Lamb.fused_lamb {_label(count, numel)}",
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
    _print_row(row)
    return [row]


def sgd_cases(args: argparse.Namespace, sizes: Sizes, ceiling: float, fused: Any, err: str | None):
    rows = []
    sgd_hp = dict(lr=0.01, momentum=0.9, weight_decay=1e-4)
    for count, numel in ((1, sizes.big), sizes.medium):
        init, grad = _master_values(count, numel, args.seed)

        def ours_build(
            count: int = count, numel: int = numel, init: torch.Tensor = init, grad: torch.Tensor = grad
        ):
            if fused is None:
                raise RuntimeError(err)
            b = make_bundle(init, grad, count, numel, dtype=torch.float32, fresh=False)
            return fused.FusedSGD(b.params, **sgd_hp).step, b

        def torch_build(
            count: int = count, numel: int = numel, init: torch.Tensor = init, grad: torch.Tensor = grad
        ):
            b = make_bundle(init, grad, count, numel, dtype=torch.float32, fresh=False)
            return torch.optim.SGD(b.params, fused=True, **sgd_hp).step, b

        ours = _try("FusedSGD", ours_build)
        ref = _try("SGD(fused)", torch_build)
        rows.append(
            compare(
                case=f"FusedSGD vs SGD(fused) {_label(count, numel)}",
                group="sgd",
                ours=ours,
                baselines=[ref],
                elements=count * numel,
                tensors=count,
                grads="reuse",
                target=1.0,
                target_pct=None,
                ceiling=ceiling,
                args=args,
                note="momentum 0.9, weight_decay 1e-4",
            )
        )
        _print_row(rows[-1])
        ours = ref = init = grad = None
        gc.collect()
    return rows


def fusedadam_cases(args: argparse.Namespace, sizes: Sizes, ceiling: float, fused: Any, err: str | None):
    rows = []
    for count, numel in ((1, sizes.big), sizes.medium):
        init, grad = _master_values(count, numel, args.seed)

        def ours_build(
            count: int = count, numel: int = numel, init: torch.Tensor = init, grad: torch.Tensor = grad
        ):
            if fused is None:
                raise RuntimeError(err)
            b = make_bundle(init, grad, count, numel, dtype=torch.float32, fresh=False)
            return fused.FusedAdam(b.params, bias_correction=True, adamw_mode=True, **HP).step, b

        def torch_build(
            count: int = count, numel: int = numel, init: torch.Tensor = init, grad: torch.Tensor = grad
        ):
            b = make_bundle(init, grad, count, numel, dtype=torch.float32, fresh=False)
            return torch.optim.AdamW(b.params, fused=True, **HP).step, b

        ours = _try("FusedAdam", ours_build)
        ref = _try("AdamW(fused)", torch_build)
        rows.append(
            compare(
                case=f"FusedAdam vs AdamW(fused) {_label(count, numel)}",
                group="adam",
                ours=ours,
                baselines=[ref],
                elements=count * numel,
                tensors=count,
                grads="reuse",
                target=1.0,
                target_pct=None,
                ceiling=ceiling,
                args=args,
            )
        )
        _print_row(rows[-1])
        ours = ref = init = grad = None
        gc.collect()
    return rows


def bit_identity(
    args: argparse.Namespace, fused: Any, err: str | None, steps: int = 5
) -> list[dict[str, Any]]:
    """Run ``steps`` steps of each optimizer and of its reference from the same start with the same per-step
    gradients, then compare params and state tensors.

    ``CPUAdam``/``FusedAdam`` and ``FusedSGD`` are held to ``torch.equal`` against torch's fused optimizers;
    ``FusedLAMB`` against ``Lamb.fused_lamb`` (a different summation order in the norms, so ``max_rel_diff`` is the
    figure there; ``bit_identity_expected`` says which).
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
    sgd_ref = ("SGD(fused=True)", lambda ps: torch.optim.SGD(ps, fused=True, **sgd_hp))
    lamb_hp = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01)
    Lamb, lamb_err = _import_lamb()
    lamb_ref = ("Lamb.fused_lamb", (lambda ps: Lamb.fused_lamb(ps, **lamb_hp)) if Lamb is not None else None)
    # (name, make, (ref name, ref make), state keys, bit identity expected)
    checks: list[tuple[str, Make | None, tuple[str, Make | None], tuple[str, ...], bool]] = [
        ("CPUAdam", None, adam_ref, ("exp_avg", "exp_avg_sq"), True),
        ("FusedAdam", None, adam_ref, ("exp_avg", "exp_avg_sq"), True),
        ("FusedSGD", None, sgd_ref, ("momentum_buffer",), True),
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


# --------------------------------------------------------------------------------------------------------
# output
# --------------------------------------------------------------------------------------------------------
COLUMNS = [
    ("case", "case", ""),
    ("grads", "grads", ""),
    ("ours_ms", "ours ms", ".2f"),
    ("torch_ms", "torch ms", ".2f"),
    ("ratio", "ratio", ".2f"),
    ("target_str", "target", ""),
    ("met_str", "met?", ""),
    ("gb_per_s", "GB/s", ".1f"),
    ("pct_of_ceiling", "% ceil", ".0f"),
    ("ratio_min", "ratio(min)", ".2f"),
]


def _decorate(row: dict[str, Any]) -> dict[str, Any]:
    r = dict(row)
    t = row.get("target")
    r["target_str"] = (
        None
        if t is None
        else f">={t:g}x"
        + (f",>={row['target_pct_of_ceiling']:g}%" if row.get("target_pct_of_ceiling") else "")
    )
    r["met_str"] = {True: "yes", False: "NO", None: "n/a"}[row.get("met")]
    return r


def _print_row(row: dict[str, Any]) -> None:
    r = _decorate(row)
    parts = [f"  {r['case']} [{r['grads']}]:"]
    for key, head, spec in COLUMNS[2:]:
        v = r.get(key)
        parts.append(f"{head}={'-' if v is None else (format(v, spec) if spec else v)}")
    print(" ".join(parts), flush=True)
    if row.get("error"):
        print(f"    ours unavailable: {row['error']}", flush=True)


def _parse_cases(text: str) -> list[str]:
    cases = [c.strip() for c in text.split(",") if c.strip()]
    bad = [c for c in cases if c not in CASE_GROUPS]
    if bad:
        raise SystemExit(f"--cases: unknown {bad}; choose from {', '.join(CASE_GROUPS)} (comma separated)")
    return cases


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="smaller sizes and 3 repeats: a smoke run")
    p.add_argument(
        "--cases", default=",".join(CASE_GROUPS), help=f"comma-separated subset of {','.join(CASE_GROUPS)}"
    )
    p.add_argument("--threads", type=int, default=0, help="intra-op threads (default: all usable cores)")
    p.add_argument(
        "--repeats", type=int, default=None, help="timed steps per contender (default 10, quick 3)"
    )
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per contender first (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-out", help="output folder for JSON + PNG (default bench-out/)")
    p.add_argument("--stem", default=None, help="output file stem (default cpu-<date>-fused[-quick])")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    return p


def main(argv: Iterable[str] | None = None) -> int:
    args = build_parser().parse_args(None if argv is None else list(argv))
    cases = _parse_cases(args.cases)
    sizes = QUICK if args.quick else FULL
    if args.repeats is None:
        args.repeats = 3 if args.quick else 10
    threads = _common.configure_threads(args.threads)
    started = time.perf_counter()
    info = _common.machine_info(threads)
    print(f"machine: {info['device']}; torch {info['torch']}; threads {threads}; load {info['load_average']}")

    fused, err = _import_fused()
    if fused is not None:
        features = getattr(fused, "cpu_features", None)
        try:
            info["stepforge_fused_cpu"] = features() if callable(features) else None
        except Exception as exc:  # a broken extension shows up in the rows below too
            info["stepforge_fused_cpu"] = f"{type(exc).__name__}: {exc}"
        print(
            f"stepforge.fused {info['stepforge'].get('stepforge-fused')} from {Path(fused.__file__ or '?').parent}"
        )
    else:
        print(f"WARNING: {err}; only the torch baselines run (ours columns stay empty).")

    print("measuring the bandwidth ceiling ...", flush=True)
    ceiling = _common.adam_pattern_ceiling(sizes.ceiling, threads=threads, repeats=max(3, args.repeats // 2))
    triad = _common.triad_bandwidth(sizes.ceiling, threads=threads, repeats=max(3, args.repeats // 2))
    cgbs = ceiling["gb_per_s"]
    print(
        f"  Adam-pattern ceiling (4R+3W, trivial math): {cgbs:.1f} GB/s   "
        f"triad: {triad['gb_per_s']:.1f} GB/s (numpy {triad['numpy_gb_per_s']:.1f}, torch {triad['torch_gb_per_s']:.1f})"
    )

    rows: list[dict[str, Any]] = []
    runners = {
        "adam": adam_cases,
        "mixed": mixed_cases,
        "lamb": lamb_cases,
        "sgd": sgd_cases,
        "fusedadam": fusedadam_cases,
    }
    identity: list[dict[str, Any]] = []
    for case in cases:
        print(f"[{case}]", flush=True)
        if case == "bitident":
            identity = bit_identity(args, fused, err)
            for r in identity:
                state = {True: "IDENTICAL", False: "DIFFERENT", None: "not run"}[r["equal"]]
                detail = r.get("error") or (
                    f"{r['mismatched_elements']} of {r['compared_elements']} differ, "
                    f"max |diff| {r['max_abs_diff']:.3g}, max rel {r['max_rel_diff']:.3g}"
                )
                want = "expected" if r["bit_identity_expected"] else "not expected"
                print(f"  {r['optimizer']} vs {r['reference']}: {state} [bit identity {want}] ({detail})")
        else:
            rows.extend(runners[case](args, sizes, cgbs, fused, err))
        gc.collect()

    # A ceiling is a maximum: measure again at the end (the load changes) and judge every row by the higher one.
    print("measuring the bandwidth ceiling again ...", flush=True)
    ceiling_end = _common.adam_pattern_ceiling(
        sizes.ceiling, threads=threads, repeats=max(3, args.repeats // 2)
    )
    ceiling["gb_per_s_start"] = cgbs
    ceiling["gb_per_s_end"] = ceiling_end["gb_per_s"]
    ceiling["gb_per_s"] = cgbs = max(cgbs, ceiling_end["gb_per_s"])
    for row in rows:
        _apply_ceiling(row, cgbs)

    print()
    print(
        f"ceiling {cgbs:.1f} GB/s (Adam pattern, {threads} threads; start {ceiling['gb_per_s_start']:.1f}, "
        f"end {ceiling['gb_per_s_end']:.1f}), triad {triad['gb_per_s']:.1f} GB/s"
    )
    print(_common.format_table([_decorate(r) for r in rows], COLUMNS))
    for r in identity:
        print(f"bit-identical {r['optimizer']} vs {r['reference']}: {r['equal']}")

    info_end_load = _common.load_average()
    date = info["date_utc"][:10]
    stem = args.stem or f"cpu-{date}-fused" + ("-quick" if args.quick else "")
    out = Path(args.out)
    payload = {
        "schema": "stepforge-bench/1",
        "bench": "bench_fused_cpu",
        "date_utc": info["date_utc"],
        "device": info["device"],
        "machine": info,
        "load_average_end": info_end_load,
        "config": {
            "quick": args.quick,
            "cases": cases,
            "threads": threads,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "seed": args.seed,
            "hyperparameters": {k: list(v) if isinstance(v, tuple) else v for k, v in HP.items()},
            "timing": "median of repeats, contenders round-robin, only optimizer.step() timed, gc off",
            "grads": "reuse = same p.grad tensors every step; fresh = alternate between two gradient sets",
            "bytes_per_element": BYTES,
        },
        "ceiling": ceiling,
        "triad": triad,
        "rows": rows,
        "bit_identity": identity,
        "fused_error": err,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    json_path = _common.save_json(out / f"{stem}.json", payload)
    print(f"wrote {json_path}")
    if not args.no_plot and rows:
        png = _common.save_ratio_plot(
            out / f"{stem}.png",
            rows=[_decorate(r) | {"case": f"{r['case']} [{r['grads']}]"} for r in rows],
            title=f"stepforge-fused CPU vs torch {info['torch']} - {info['device']}, {threads} threads, {info['date_utc']}",
            ceiling_gb_per_s=cgbs,
        )
        print(f"wrote {png}")
    print(f"done in {payload['wall_s']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
