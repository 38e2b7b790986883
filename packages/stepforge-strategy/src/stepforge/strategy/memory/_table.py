# SPDX-License-Identifier: Apache-2.0
"""Estimates as text tables: one estimate, or several side by side (the console command)."""

from __future__ import annotations

import textwrap
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
    activation_checkpointing: bool

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


def _fits_cell(fit: bool | None) -> str:
    return "unknown" if fit is None else "yes" if fit else "NO"


def _head(first: EstimateRow, precision: str | None) -> str:
    head = (
        f"per rank of {first.world_size} (rank {first.rank}), {first.parameters / 1e6:,.1f} M parameters, "
        + (f"{precision}, " if precision else "")
        + f"optimizer {first.optimizer or 'none'}, backend {first.backend}"
    )
    head += f", {first.accumulation_steps} micro-batches per step" if first.accumulation_steps > 1 else ""
    if first.activations is not None:  # how, on a line of its own
        head += f"\nactivations traced on {first.activations.method} tensors" + (
            ", blocks recomputed in backward (activation checkpointing)"
            if first.activation_checkpointing
            else ""
        )
    return head


def _columns(header: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> list[str]:
    """``rows`` under ``header``, two spaces apart; the first ``left`` columns left-aligned, the rest right."""
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    lines = []
    for row in (header, *rows):
        cells = [
            c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    lines.insert(1, "-" * max(len(line) for line in lines))
    return lines


def estimate_table(estimates: Sequence[EstimateRow], *, fits: Sequence[bool | None] | None = None) -> str:
    """Estimates as text. One: device and host bytes per component, the peaks and the bytes sent per step, one
    row each. Several: one row per estimate (plugin and settings) with what the device holds between steps, the
    activations, the device and host peaks, the bytes sent per step and (``fits``: ``None`` is unknown) whether
    it fits; 100 columns wide for the default plugins."""
    if not estimates:
        return "(no estimates)"
    if len(estimates) == 1:
        return _components_table(estimates[0], fits)
    first = estimates[0]
    precisions = {e.precision for e in estimates}
    shared = first.precision if len(precisions) == 1 else None
    accumulating = any(e.accumulation_steps > 1 for e in estimates)
    traced = first.activations is not None
    header = [
        "plugin",
        "held",
        "acts",
        "peak",
        "host peak",
        *(["window"] if accumulating else []),
        "sent/step",
    ]
    header += ["fits"] if fits is not None else []
    rows = []
    for i, e in enumerate(estimates):
        label = column_title(e) + ("" if shared else f" [{e.precision}]")
        held = sum(e.device[c] for c in COMPONENTS[:-1])
        row = [label, format_bytes(held), format_bytes(e.device["activations"]) if traced else "-"]
        row += [format_bytes(e.device["peak"]), format_bytes(e.host["peak"])]
        row += [format_bytes(e.window["device"])] if accumulating else []
        row += [format_bytes(e.sent_bytes)]
        row += [_fits_cell(fits[i])] if fits is not None else []
        rows.append(row)
    legend = (
        "held: device bytes kept between steps (parameters, gradients, master weights, optimizer state, buffers); "
        "acts: traced activations; peak: the most device bytes at once over a step; "
        + ("window: device bytes between micro-batches; " if accumulating else "")
        + "sent/step: bytes this rank sends per optimizer step."
    )
    return "\n".join(
        [_head(first, shared), *_columns(header, rows), *textwrap.wrap(legend, 100), *_notes(first, fits)]
    )


def _notes(first: EstimateRow, fits: Sequence[bool | None] | None) -> list[str]:
    notes = [] if first.activations is not None else ["activations: not traced (no inputs)."]
    if fits is not None and None in fits:
        notes.append(
            "fits: unknown (activations not estimated): the model states fit; give an example batch."
        )
    return notes


def _components_table(est: EstimateRow, fits: Sequence[bool | None] | None) -> str:
    rows: list[list[str]] = []
    for place in ("device", "host"):
        for component in (*COMPONENTS, "peak"):
            value = getattr(est, place)[component]
            if component == "peak" or value:
                rows.append([f"{place} {component}", format_bytes(value)])
        if est.accumulation_steps > 1:
            rows.append([f"{place} between micro-batches", format_bytes(est.window[place])])
    rows.append(["sent per step", format_bytes(est.sent_bytes)])
    rows += [["fits", _fits_cell(fits[0])]] if fits is not None else []
    return "\n".join(
        [_head(est, est.precision), *_columns(["", column_title(est)], rows), *_notes(est, fits)]
    )


def markdown_table(estimates: Sequence[EstimateRow], *, fits: Sequence[bool | None] | None = None) -> str:
    """One row per estimate (plugin and settings): device bytes per component and peak, host peak, bytes sent
    per step, and (``fits``; ``None``: unknown) whether it fits, as a Markdown table; accumulating, also what the device holds
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
            cells.append("unknown" if fits[i] is None else "yes" if fits[i] else "no")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
