# SPDX-License-Identifier: Apache-2.0
"""What ``bench_capacity.py`` reports once its searches are done: the summary table, the plot, and
``stepforge.strategy.estimate``'s figures beside the measured ones (when that function imports)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.common import _report
from bench.gpu_train._gpt import GPT, GPTShape
from bench.gpu_train._search import TryResult

__all__ = ["ESTIMATE_AS", "as_try", "estimates", "plot", "summary_table"]

GIB = 2**30

#: what the estimate is asked for, per contender: (plugin, plugin arguments, optimizer type)
ESTIMATE_AS: dict[str, tuple[str, dict[str, Any], str]] = {
    "fused": ("single", {}, "FusedAdam"),
    "zero2_offload": ("zero2", {"cpu_offload": True}, "HybridAdam"),
    "gemini": ("gemini", {"placement_policy": "auto"}, "HybridAdam"),
}


def as_try(r: dict[str, Any]) -> TryResult:
    """A try's result file as the search reads it: device bytes = the allocator's peak reserved, host bytes = the
    peak resident size beyond the try's start-up."""
    device, host = r.get("device") or {}, r.get("host") or {}
    dev = device.get("peak_reserved")
    host_bytes = host["peak_rss"] - host["baseline_rss"] if host.get("peak_rss") is not None else None
    return TryResult(r["depth"], bool(r["ok"]), r["parameters"], dev, host_bytes)


def summary_table(contenders: dict[str, Any]) -> str:
    """Per contender: the largest that trained, its bytes per parameter, the first failure, what bounded it."""
    rows = []
    for name, e in contenders.items():
        largest = e.get("largest") or {}
        rows.append({
            "contender": name, "depth": largest.get("depth"), "params_b": (largest.get("parameters") or 0) / 1e9,
            "dev_bpp": largest.get("device_bytes_per_param"), "host_bpp": largest.get("host_bytes_per_param"),
            "hi": e["bracket"]["hi"], "bound": e.get("bound"), "stopped": e.get("stopped"),
        })  # fmt: skip
    return _report.format_table(rows, [
        ("contender", "contender", "s"), ("depth", "depth", ""), ("params_b", "params (B)", ".2f"),
        ("dev_bpp", "dev B/param", ".1f"), ("host_bpp", "host B/param", ".1f"), ("hi", "first fail", ""),
        ("bound", "bound", ""), ("stopped", "stopped", ""),
    ])  # fmt: skip


def estimates(
    args: argparse.Namespace, contenders: dict[str, Any], shape_of: Callable[[int], GPTShape]
) -> dict[str, Any]:
    """``stepforge.strategy.estimate`` at each contender's bracket (its deepest pass, then its first failure), within
    ``--estimate-budget-s`` (what is left out is named), or why it is absent."""
    try:
        from stepforge.strategy import estimate
    except ImportError as exc:
        return {"available": False, "why": f"{type(exc).__name__}: {exc}"}
    out: dict[str, Any] = {"available": True, "figures": {}, "skipped": []}
    t0 = time.perf_counter()
    for name, entry in contenders.items():
        plugin, kwargs, optimizer = ESTIMATE_AS[name]
        for depth in [d for d in (entry["bracket"]["lo"], entry["bracket"]["hi"]) if d]:
            if time.perf_counter() - t0 > args.estimate_budget_s:
                out["skipped"].append(
                    f"{name} at depth {depth}: --estimate-budget-s {args.estimate_budget_s:g} spent"
                )
                continue
            shape = shape_of(depth)
            with torch.device("meta"):
                model = GPT(shape)
                inputs = torch.zeros(args.batch, args.seq_len, dtype=torch.long)
            try:
                est = estimate(
                    model,
                    plugin=plugin,
                    world_size=1,
                    precision="bf16",
                    optimizer=dict(type=optimizer, lr=3e-4),
                    inputs=inputs,
                    device=args.device,
                    **kwargs,
                ).to_dict()
                figures = {
                    "device_peak": est["device"]["peak"],
                    "host_peak": est["host"]["peak"],
                    "device": est["device"],
                    "host": est["host"],
                }
            except Exception as exc:  # a side figure: its failure is recorded
                figures = {"error": f"{type(exc).__name__}: {exc}"}
            out["figures"].setdefault(name, {})[str(depth)] = figures
    return out


def plot(payload: dict[str, Any], parameters_of: Callable[[int], int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    colours = {"fused": "tab:blue", "zero2_offload": "tab:orange", "gemini": "tab:green"}
    for name, entry in payload["contenders"].items():
        c = colours.get(name, "tab:gray")
        for r in entry["tries"]:
            t = as_try(r)
            x = t.parameters / 1e9
            if t.device_bytes is not None:
                left.scatter([x], [t.device_bytes / GIB], color=c, marker="o" if t.ok else "x")
            if t.host_bytes is not None:
                left.scatter(
                    [x], [t.host_bytes / GIB], facecolors="none", edgecolors=c, marker="s" if t.ok else "X"
                )
        left.scatter([], [], color=c, label=name)
    left.set_xlabel("parameters (B)")
    left.set_ylabel("peak GiB")
    left.set_title("filled: device (reserved); hollow: host beyond start-up; x: the try failed", fontsize=8)
    left.legend(fontsize=8)
    names = list(payload["contenders"])
    lo = [(payload["contenders"][n].get("largest") or {}).get("parameters", 0) / 1e9 for n in names]
    hi = [
        parameters_of(e["bracket"]["hi"]) / 1e9 if e["bracket"]["hi"] else 0
        for e in payload["contenders"].values()
    ]
    right.bar(names, hi, color="lightgray", label="first failing depth")
    right.bar(names, lo, color=[colours.get(n, "tab:gray") for n in names], label="largest that trained")
    for i, v in enumerate(lo):
        right.text(i, v, f"{v:.2f} B", ha="center", va="bottom", fontsize=8)
    right.set_ylabel("parameters (B)")
    right.legend(fontsize=8)
    fig.suptitle(payload["title"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
