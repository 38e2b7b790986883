# SPDX-License-Identifier: Apache-2.0
"""Shared pieces of ``bench_fused_cpu.py``: sizes, hyper-parameters, tensors, one timed comparison, output rows."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from bench.common import _timing

__all__ = [
    "BYTES",
    "CASE_GROUPS",
    "COLUMNS",
    "FULL",
    "HP",
    "QUICK",
    "Bundle",
    "Contender",
    "Sizes",
    "apply_ceiling",
    "compare",
    "decorate",
    "import_fused",
    "import_lamb",
    "case_label",
    "copy_bandwidth",
    "make_bundle",
    "master_values",
    "print_row",
    "try_build",
]

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


def case_label(count: int, numel: int) -> str:
    def short(n: int) -> str:
        for unit, div in (("M", 1_000_000), ("k", 1_000)):
            if n % div == 0 and n >= div:
                return f"{n // div}{unit}"
        return str(n)

    return f"{count}x{short(numel)}"


# --------------------------------------------------------------------------------------------------------
# the code under test, imported lazily so the torch baselines still run before stepforge-fused is installed
# --------------------------------------------------------------------------------------------------------
def import_fused() -> tuple[Any, str | None]:
    try:
        import stepforge.fused as fused
    except Exception as exc:  # ImportError, or an extension that fails to load
        return None, f"stepforge.fused is not importable ({type(exc).__name__}: {exc})"
    return fused, None


def import_lamb() -> tuple[Any, str | None]:
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


def master_values(count: int, numel: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
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
    # Half the repeats in each order (ours first, then ours last): a contender that always runs right after
    # another one inherits its after-effects (dirty lines being written back, the other's spinning threads).
    order = [(c.name, c.step) for c in contenders]
    half = max(1, args.repeats // 2)
    timings = _timing.time_interleaved(dict(order), warmup=args.warmup, repeats=half, before=before)
    if args.repeats > half:
        rest = _timing.time_interleaved(
            dict(order[::-1]), warmup=0, repeats=args.repeats - half, before=before
        )
        for name, t in rest.items():
            timings[name].samples_ms.extend(t.samples_ms)
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
    apply_ceiling(row, ceiling)
    return row


def copy_bandwidth(n: int, *, threads: int, repeats: int) -> dict[str, Any]:
    """STREAM-like copy ``a[:] = b`` (fp32, torch's own threading), counted as 8 B per element (STREAM
    convention: the write-allocate read is not counted)."""
    gen = torch.Generator().manual_seed(2)
    a = torch.zeros(n)
    b = torch.randn(n, generator=gen)
    t = _timing.time_interleaved({"copy": lambda: a.copy_(b)}, warmup=1, repeats=repeats)["copy"]
    return {"gb_per_s": 8 * n / (t.median_ms * 1e-3) / 1e9, "ms": t.median_ms, "elements": n,
            "bytes_per_element": 8, "threads": threads}  # fmt: skip


def apply_ceiling(row: dict[str, Any], ceiling: float | None, stream: dict[str, float] | None = None) -> None:
    """Set ``pct_of_ceiling`` and ``met`` of ``row`` for the Adam-pattern ``ceiling`` in GB/s, and beside it
    the row's GB/s as a share of the STREAM-like ``stream`` figures (``{"copy": GB/s, "triad": GB/s}``)."""
    row["pct_of_ceiling"] = 100.0 * row["gb_per_s"] / ceiling if row["gb_per_s"] and ceiling else None
    for name, gbs in (stream or {}).items():
        row[f"{name}_gb_per_s"] = gbs
        row[f"pct_of_{name}"] = 100.0 * row["gb_per_s"] / gbs if row["gb_per_s"] and gbs else None
    target, target_pct = row["target"], row["target_pct_of_ceiling"]
    if row["ratio"] is None or target is None:
        row["met"] = None
    else:
        row["met"] = row["ratio"] >= target and (
            target_pct is None or (row["pct_of_ceiling"] is not None and row["pct_of_ceiling"] >= target_pct)
        )


def try_build(name: str, build: Callable[[], tuple[Callable[[], Any], Bundle]]) -> Contender:
    try:
        step, bundle = build()
    except Exception as exc:
        return Contender(name, None, error=f"{type(exc).__name__}: {exc}")
    return Contender(name, step, bundle)


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
    ("pct_of_triad", "% triad", ".0f"),
    ("pct_of_copy", "% copy", ".0f"),
    ("ratio_min", "ratio(min)", ".2f"),
]


def decorate(row: dict[str, Any]) -> dict[str, Any]:
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


def print_row(row: dict[str, Any]) -> None:
    r = decorate(row)
    parts = [f"  {r['case']} [{r['grads']}]:"]
    for key, head, spec in COLUMNS[2:]:
        v = r.get(key)
        parts.append(f"{head}={'-' if v is None else (format(v, spec) if spec else v)}")
    print(" ".join(parts), flush=True)
    if row.get("error"):
        print(f"    ours unavailable: {row['error']}", flush=True)
