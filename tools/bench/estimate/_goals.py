# SPDX-License-Identifier: Apache-2.0
"""The judging of ``bench_estimate.py``: ratios estimate / measured against the goals, DeepSpeed's formulas for
the same configuration, the summary the "What fits" page quotes, and the plot; the device figures against
``torch.cuda``'s counts (also ``bench_architectures.py``'s).

Imported by the drivers, ``estimate/bench_estimate.py`` and ``estimate/bench_architectures.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import nn

__all__ = [
    "COMPONENTS",
    "TOTAL_GOAL",
    "COMPONENT_GOAL",
    "deepspeed_bytes",
    "judge",
    "cuda_judge",
    "summary",
    "cuda_summary",
    "plot",
]

COMPONENTS = ("params", "grads", "master", "optimizer_state", "buffers")
TOTAL_GOAL = 0.10
COMPONENT_GOAL = 0.15
#: a component under this share of the held total is reported, not judged
NEGLIGIBLE = 0.01
TOTALS = ("after_boost", "held_total", "peak", "window")


def _largest_layer(model: nn.Module) -> int:
    return max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())


def deepspeed_bytes(
    label: str, config: str, world: int, params: int, model: nn.Module
) -> dict[str, Any] | None:
    """DeepSpeed's per-rank model-state formula for the configuration, where one exists (AdamW with 16-bit
    parameters: ZeRO-2 with or without optimizer offload, ZeRO-3 for the FSDP2 plugins), one node of ``world``
    ranks. Its host figure is per node: divided by the ranks on the node for a per-rank number."""
    if config != "adamw-bf16":
        return None
    gpus, buffer_factor = world, 1.5
    if label == "zero2":  # estimate_zero2_model_states_mem_needs(cpu_offload=False)
        return dict(formula="zero2", bytes=int(2 * params + 18 * params / gpus))
    if label == "zero2-offload":  # cpu_offload=True: 2P on the GPU, P * max(4N, 16) * 1.5 on the node
        host = params * max(4 * gpus, 16) * buffer_factor
        return dict(formula="zero2 offload", bytes=int(2 * params + host / gpus))
    if label in ("torch_fsdp", "gemini"):  # estimate_zero3_model_states_mem_needs(cpu_offload=False): the GPU
        return dict(formula="zero3", bytes=int(4 * _largest_layer(model) + 18 * params / gpus))
    return None


def _ratio(estimated: int, measured: int) -> float | None:
    return estimated / measured if measured else None


def _ratio_or_match(estimated: int, measured: int) -> float | None:
    """``estimated / measured``; 1.0 where both are nothing, ``None`` where only the measurement is."""
    return _ratio(estimated, measured) if measured else (1.0 if not estimated else None)


def judge(row: dict[str, Any]) -> dict[str, Any]:
    """``ratios``, ``met`` (per ratio: within its goal; ``None``: not judged) and ``deepspeed_ratio`` /
    ``closer_than_deepspeed`` for one case."""
    est, meas = row["estimate"], row["measured"]
    held = meas["after_step"]
    ratios: dict[str, float | None] = {
        "after_boost": _ratio(est["after_boost"], meas["after_boost"]["total"]),
        "held_total": _ratio(est["held_total"], held["total"]),
        "peak": _ratio(est["peak"], meas["peak"]),
        "activations": _ratio(est["activations"], meas["activations"]),
    }
    # between two micro-batches of a window: measured only when accumulating
    window = meas.get("window")
    ratios["window"] = _ratio(est["window"], window["total"]) if window else None
    met: dict[str, bool | None] = {}
    for key in TOTALS:
        value = ratios[key]
        if key == "window" and not window:
            met[key] = None
            continue
        met[key] = value is not None and abs(value - 1) <= TOTAL_GOAL
    value = ratios["activations"]
    met["activations"] = value is not None and abs(value - 1) <= COMPONENT_GOAL
    for component in COMPONENTS:
        measured, estimated = held[component], est["held"][component]
        negligible = max(measured, estimated) < NEGLIGIBLE * held["total"]
        ratios[component] = _ratio_or_match(estimated, measured)
        value = ratios[component]
        met[component] = None if negligible else value is not None and abs(value - 1) <= COMPONENT_GOAL
    out: dict[str, Any] = dict(ratios=ratios, met=met)
    ds = row.get("deepspeed")
    if ds is not None:
        ds_ratio = ds["bytes"] / held["total"]
        out["deepspeed_ratio"] = ds_ratio
        out["closer_than_deepspeed"] = abs((ratios["held_total"] or 0) - 1) < abs(ds_ratio - 1)
    return out


def cuda_judge(est: dict[str, Any], measured: dict[str, Any]) -> dict[str, Any]:
    """Where the run trained on CUDA (``measured["cuda"]``): ``cuda_ratios``, the estimate's device figures
    against the allocator's own counts (``held``: device held / ``memory_allocated`` after the step; ``peak``:
    device peak / ``max_memory_allocated`` over the step), and ``cuda_within``: both within :data:`TOTAL_GOAL`
    (issue #43's ±10% of ``max_memory_allocated``). Else nothing."""
    cuda = measured.get("cuda")
    if not cuda:
        return {}
    ratios = dict(
        held=_ratio_or_match(est["device_held"], cuda["after_step"]),
        peak=_ratio_or_match(est["device_peak"], cuda["peak"]),
    )
    within = all(r is not None and abs(r - 1) <= TOTAL_GOAL for r in ratios.values())
    return dict(cuda_ratios=ratios, cuda_within=within)


def cuda_summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per CUDA ratio (``held``, ``peak``) over the rows that have it: min, max, cases and how many within
    :data:`TOTAL_GOAL`; empty where no row trained on CUDA."""
    out = {}
    for key in ("held", "peak"):
        values = [r["cuda_ratios"][key] for r in rows if r.get("cuda_ratios", {}).get(key) is not None]
        if values:
            out[key] = dict(
                min=min(values),
                max=max(values),
                cases=len(values),
                within=sum(1 for v in values if abs(v - 1) <= TOTAL_GOAL),
                goal=TOTAL_GOAL,
            )
    return out


def summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per quantity: cases judged, min/max ratio, how many within the goal; and the DeepSpeed comparison."""
    lines = []
    names = {
        "after_boost": "total after boost",
        "held_total": "total held after a step",
        "peak": "peak over a step",
        "window": "total between micro-batches",
        "activations": "activations (forward)",
    }
    for key in (*TOTALS, "activations", *COMPONENTS):
        judged = [r for r in rows if r["met"].get(key) is not None and r["ratios"].get(key) is not None]
        if not judged:
            continue
        values = [r["ratios"][key] for r in judged]
        lines.append(
            dict(
                quantity=names.get(key, key),
                key=key,
                cases=len(judged),
                min=min(values),
                max=max(values),
                within=sum(1 for r in judged if r["met"][key]),
                goal=TOTAL_GOAL if key in TOTALS else COMPONENT_GOAL,
            )
        )
    compared = [r for r in rows if "deepspeed_ratio" in r]
    if compared:
        ours = [r["ratios"]["held_total"] for r in compared]
        theirs = [r["deepspeed_ratio"] for r in compared]
        closer = sum(1 for r in compared if r["closer_than_deepspeed"])
        text = (
            f"DeepSpeed's formulas apply to {len(compared)} cases (AdamW, bf16: zero2, zero2 offload, zero3 for "
            f"torch_fsdp and gemini); against the measured total held after a step the estimate is "
            f"{min(ours):.3f}-{max(ours):.3f}, DeepSpeed's formula {min(theirs):.3f}-{max(theirs):.3f}; the "
            f"estimate is closer in {closer} of {len(compared)}."
        )
    else:
        text = "DeepSpeed's formulas apply to none of these cases."
    return dict(rows=lines, deepspeed=text)


def plot(path: Path, rows: Sequence[dict[str, Any]], *, title: str) -> None:
    """Left: the totals' ratios per case (goal band ±10%) and DeepSpeed's; right: the components' (±15%)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [
        f"{r['plugin']} {r['config']} N={r['world']}"
        + (f" r{r['rank']}" if "rank" in r else "")
        + (f" x{r['accumulation']}" if r.get("accumulation", 1) > 1 else "")
        for r in rows
    ]
    y = list(range(len(rows)))
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 0.28 * len(rows) + 2.5), sharey=True)
    markers = {"after_boost": "s", "held_total": "o", "peak": "^", "window": "v", "activations": "x"}
    for key, marker in markers.items():
        xs = [r["ratios"].get(key) for r in rows]
        left.scatter(
            [x for x in xs if x],
            [yi for yi, x in zip(y, xs, strict=True) if x],
            marker=marker,
            label=key,
            s=22,
        )
    ds = [(yi, r["deepspeed_ratio"]) for yi, r in zip(y, rows, strict=True) if "deepspeed_ratio" in r]
    if ds:
        left.scatter(
            [d[1] for d in ds], [d[0] for d in ds], marker="D", color="black", label="DeepSpeed formula", s=22
        )
    left.axvspan(1 - TOTAL_GOAL, 1 + TOTAL_GOAL, color="tab:green", alpha=0.12)
    left.set_xscale("log")
    left.set_xlabel("estimate / measured (log; band: ±10%)")
    left.legend(fontsize=7, loc="lower right")
    left.set_yticks(y, labels, fontsize=7)
    left.invert_yaxis()
    for component in COMPONENTS:
        pts = [(yi, r["ratios"][component]) for yi, r in zip(y, rows, strict=True)
               if r["met"].get(component) is not None and r["ratios"].get(component)]  # fmt: skip
        right.scatter([p[1] for p in pts], [p[0] for p in pts], label=component, s=18)
    right.axvspan(1 - COMPONENT_GOAL, 1 + COMPONENT_GOAL, color="tab:green", alpha=0.12)
    right.set_xlabel("component estimate / measured (band: ±15%)")
    right.legend(fontsize=7, loc="lower right")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
