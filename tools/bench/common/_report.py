# SPDX-License-Identifier: Apache-2.0
"""Recording a benchmark run: JSON (NaN/inf as null), plain-text tables and the speed-up/GB-s plot.

Imported by the scripts as ``_report``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.common._timing import Timing

__all__ = ["format_table", "save_json", "save_ratio_plot"]


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, Timing):
        return obj.to_dict()
    if hasattr(obj, "__dataclass_fields__"):
        return _jsonable(asdict(obj))
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None  # JSON has no NaN/inf
    return obj


def save_json(path: str | os.PathLike[str], payload: Mapping[str, Any]) -> Path:
    """Write ``payload`` as indented JSON (NaN/inf become null), creating parent folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_jsonable(payload), indent=2) + "\n")
    return path


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, str, str]]) -> str:
    """A plain-text table.

    Args:
        rows: dicts of values.
        columns: ``(key, header, format)``; ``format`` is a format spec (``".2f"``) or ``""`` for ``str``.
            Missing or None values print as ``-``.
    """
    cells = [[h for _, h, _ in columns]]
    for row in rows:
        line = []
        for key, _, spec in columns:
            v = row.get(key)
            if v is None or (isinstance(v, float) and math.isnan(v)):
                line.append("-")
            else:
                line.append(format(v, spec) if spec else str(v))
        cells.append(line)
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    out = []
    for i, r in enumerate(cells):
        out.append(
            "  ".join(
                c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths, strict=True))
            )
        )
        if i == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def save_ratio_plot(
    path: str | os.PathLike[str],
    rows: Sequence[Mapping[str, Any]],
    *,
    title: str,
    ceiling_gb_per_s: float | None = None,
) -> Path:
    """Two panels: speed-up over the baseline per case (target marked), and effective GB/s (ceiling marked).

    Each row needs ``case``, ``ratio``; optional ``target``, ``gb_per_s``, ``baseline_gb_per_s``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [r for r in rows if r.get("ratio") is not None and math.isfinite(r["ratio"])]
    labels = [r["case"] for r in rows]
    y = list(range(len(rows)))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 0.45 * len(rows) + 2.2), sharey=True)
    colors = [
        "tab:green" if r.get("met") else ("tab:red" if r.get("met") is False else "tab:gray") for r in rows
    ]
    ax1.barh(y, [r["ratio"] for r in rows], color=colors)
    for yi, r in zip(y, rows, strict=True):
        if r.get("target"):
            ax1.plot([r["target"], r["target"]], [yi - 0.4, yi + 0.4], color="black", lw=2)
        ax1.text(r["ratio"], yi, f" {r['ratio']:.2f}x", va="center", fontsize=8)
    ax1.axvline(1.0, color="gray", ls=":", lw=1)
    ax1.set_xscale("log")
    if rows:
        hi = max(max(r["ratio"] for r in rows), max((r.get("target") or 1.0) for r in rows))
        ax1.set_xlim(min(0.5, 0.8 * min(r["ratio"] for r in rows)), 2.0 * hi)  # room for the labels
    ax1.set_yticks(y, labels, fontsize=8)
    ax1.invert_yaxis()
    ax1.set_xlabel("speed-up over torch baseline (log; black tick = target)")
    gbs = [r.get("gb_per_s") or 0.0 for r in rows]
    base = [r.get("baseline_gb_per_s") or 0.0 for r in rows]
    ax2.barh([yi - 0.2 for yi in y], gbs, height=0.4, label="stepforge", color="tab:blue")
    ax2.barh([yi + 0.2 for yi in y], base, height=0.4, label="torch baseline", color="tab:orange")
    if ceiling_gb_per_s:
        ax2.axvline(
            ceiling_gb_per_s, color="black", ls="--", lw=1, label=f"ceiling {ceiling_gb_per_s:.0f} GB/s"
        )
    ax2.set_xlabel("effective GB/s (minimum bytes moved / time)")
    ax2.legend(fontsize=8, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
