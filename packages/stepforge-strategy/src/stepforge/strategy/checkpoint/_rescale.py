# SPDX-License-Identifier: Apache-2.0
"""Resume with the global batch kept at another accumulation count: the iteration counters in the new unit.

An iteration is one micro-batch on every rank (mmengine's ``iter``: ``cur_iter``, the accumulation window's
``inner_count``, the clock of the schedulers stepped per iteration). With ``Strategy(global_batch_size=G)`` a
resume at another world size (or micro-batch) changes ``accumulative_counts`` from ``c_old`` to ``c_new`` while an
optimizer step still consumes ``G`` samples, so ``k`` optimizer steps are ``k * c_new`` iterations now: every
iteration counter is multiplied by ``c_new / c_old``. The optimizer's own step counts, the window's ``steps`` and
epoch-based schedulers do not depend on the count and stay. A schedule stepped per iteration keeps this run's
``begin``/``end``/lengths (built for this world size, e.g. ``convert_to_iter_based`` with this ``epoch_length``)
and takes only its position from the checkpoint.

Only positions at an accumulation-window boundary convert exactly; anything else raises before a byte is applied.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

from ._layout import CheckpointMismatchError

__all__ = ["IterationScale", "iteration_scale"]


class IterationScale:
    """Multiplies iteration counts by ``new / old`` (accumulation counts), refusing a count it cannot convert."""

    def __init__(self, old: int, new: int, filename: str) -> None:
        self.old, self.new, self.filename = old, new, filename
        self.ratio = Fraction(new, old)

    def __call__(self, what: str, count: int) -> int:
        scaled = count * self.ratio
        if scaled.denominator != 1:
            raise CheckpointMismatchError(
                f"{self.filename!r}: {what}={count} is not a whole number of accumulation windows of "
                f"{self.old}, so it has no equivalent at accumulative_counts={self.new}; resume from a checkpoint "
                "saved at a window boundary"
            )
        return int(scaled)

    def window(self, state: Mapping[str, Any], live: Mapping[str, Any]) -> dict[str, Any]:
        """The accumulation window's saved state in the new unit (``max_counts`` is this run's)."""
        if state.get("position"):
            raise CheckpointMismatchError(
                f"{self.filename!r} was saved {state['position']} micro-batch(es) into an accumulation window of "
                f"{self.old}; at accumulative_counts={self.new} resume from a checkpoint saved at a window boundary"
            )
        epoch_end = state.get("epoch_end")
        return {
            **state,
            "counts": self.new,
            "inner_count": self("inner_count", int(state["inner_count"])),
            "offset": self("offset", int(state.get("offset", 0))),
            "epoch_end": None if epoch_end is None else self("epoch_end", int(epoch_end)),
            "max_counts": live["max_counts"],
        }

    def schedulers(self, live: Sequence[Any], saved: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """The saved scheduler states to load: per-epoch ones as saved, per-iteration ones as this run built them
        with the saved position converted (stepforge's ``_global_step``/``last_step``, torch's ``last_epoch``)."""
        out: list[dict[str, Any]] = []
        for sched, state in zip(live, saved, strict=True):
            if state.get("by_epoch", True):
                out.append(dict(state))
                continue
            new = dict(sched.state_dict())
            if "_global_step" in state:
                step = self("scheduler _global_step", int(state["_global_step"]))
                begin, end = new["begin"], new["end"]
                new["_global_step"] = step
                new["last_step"] = min(step, end - 1) - begin if step >= begin else -1
            if "last_epoch" in state:
                new["last_epoch"] = self("scheduler last_epoch", int(state["last_epoch"]))
                new["_step_count"] = new["last_epoch"] + 1
            for key in ("_last_value", "_last_lr"):
                if key in state:
                    new[key] = state[key]
            out.append(new)
        return out


def iteration_scale(
    meta: Mapping[str, Any], global_batch: int | None, counts: int, filename: str
) -> IterationScale | None:
    """The conversion a resume needs: ``None`` unless this run keeps a global batch (``global_batch``), the
    checkpoint was saved with the same one and the accumulation count differs."""
    old = meta.get("accumulative_counts")
    if global_batch is None or meta.get("global_batch_size") != global_batch or not isinstance(old, int):
        return None
    return None if old == counts else IterationScale(old, counts, filename)
