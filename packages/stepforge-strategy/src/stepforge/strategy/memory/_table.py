# SPDX-License-Identifier: Apache-2.0
"""Estimates as text tables: one estimate, or several side by side (the console command)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from stepforge.core.memory_plan import COMPONENTS

__all__ = ["estimate_table", "markdown_table", "format_bytes", "column_title", "EstimateRow"]


class EstimateRow(Protocol):
    """What the tables read of an :class:`~stepforge.strategy.memory.Estimate`."""

    plugin: str
    settings: dict[str, Any]
    world_size: int
    rank: int
    precision: str
    optimizer: str | None
    backend: str
    parameters: int
    device: dict[str, int]
    host: dict[str, int]
    window: dict[str, int]
    activations: Any

    @property
    def accumulation_steps(self) -> int: ...

    @property
    def sent_bytes(self) -> int: ...


_UNITS = (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024))


def format_bytes(nbytes: int) -> str:
    """``nbytes`` in the largest binary unit that keeps it at or above 1 (``"1.50 GiB"``, ``"0 B"``)."""
    for unit, size in _UNITS:
        if abs(nbytes) >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes} B"


def column_title(est: EstimateRow) -> str:
    """The plugin name and the settings that differ from its defaults (``"zero2 cpu_offload=True"``)."""
    extra = " ".join(f"{k}={v}" for k, v in est.settings.items())
    return f"{est.plugin} {extra}".strip()


def estimate_table(estimates: Sequence[EstimateRow], *, fits: Sequence[bool | None] | None = None) -> str:
    """A table with one column per estimate: device and host bytes per component and peak, bytes sent per step,
    and (``fits``) whether each fits the given memory."""
    if not estimates:
        return "(no estimates)"
    first = estimates[0]
    head = (
        f"per rank of {first.world_size} (rank {first.rank}), {first.parameters / 1e6:,.1f} M parameters, "
        f"optimizer {first.optimizer or 'none'}, backend {first.backend}"
    )
    accumulating = any(e.accumulation_steps > 1 for e in estimates)
    if accumulating:
        head += f", {first.accumulation_steps} micro-batches per step"
    if first.activations is not None:  # how, on a line of its own
        head += f"\nactivations traced on {first.activations.method} tensors" + (
            ", blocks recomputed in backward (activation checkpointing)"
            if first.activation_checkpointing
            else ""
        )
    titles = [column_title(e) + f" [{e.precision}]" for e in estimates]
    rows: list[tuple[str, list[str]]] = []
    for place in ("device", "host"):
        for component in (*COMPONENTS, "peak"):
            values = [getattr(e, place)[component] for e in estimates]
            if component != "peak" and not any(values):
                continue
            rows.append((f"{place} {component}", [format_bytes(v) for v in values]))
        if accumulating:
            values = [e.window[place] for e in estimates]
            rows.append((f"{place} between micro-batches", [format_bytes(v) for v in values]))
    rows.append(("sent per step", [format_bytes(e.sent_bytes) for e in estimates]))
    if fits is not None:
        rows.append(("fits", ["-" if f is None else "yes" if f else "NO" for f in fits]))
    if first.activations is None:
        rows.append(
            ("activations", ["not traced (no inputs)" if i == 0 else "" for i in range(len(estimates))])
        )
    label_width = max(len(r[0]) for r in rows)
    widths = [max(len(t), *(len(r[1][i]) for r in rows)) for i, t in enumerate(titles)]
    lines = [
        head,
        " " * label_width + " | " + " | ".join(t.rjust(w) for t, w in zip(titles, widths, strict=True)),
    ]
    lines.append("-" * len(lines[-1]))
    for label, values in rows:
        lines.append(
            label.ljust(label_width)
            + " | "
            + " | ".join(v.rjust(w) for v, w in zip(values, widths, strict=True))
        )
    return "\n".join(lines)


def markdown_table(estimates: Sequence[EstimateRow], *, fits: Sequence[bool | None] | None = None) -> str:
    """One row per estimate (plugin and settings): device bytes per component and peak, host peak, bytes sent
    per step, and (``fits``) whether it fits, as a Markdown table; accumulating, also what the device holds
    between micro-batches."""
    components = [c for c in COMPONENTS if any(e.device[c] for e in estimates)]
    accumulating = any(e.accumulation_steps > 1 for e in estimates)
    window = ["device between micro-batches"] if accumulating else []
    head = [
        "plugin",
        *(f"device {c}" for c in components),
        *window,
        "device peak",
        "host peak",
        "sent / step",
    ]
    if fits is not None:
        head.append("fits")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, e in enumerate(estimates):
        cells = [f"`{column_title(e)}`"]
        cells += [format_bytes(e.device[c]) for c in components]
        cells += [format_bytes(e.window["device"])] if accumulating else []
        cells += [
            f"**{format_bytes(e.device['peak'])}**",
            format_bytes(e.host["peak"]),
            format_bytes(e.sent_bytes),
        ]
        if fits is not None:
            cells.append("-" if fits[i] is None else "yes" if fits[i] else "no")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
