# SPDX-License-Identifier: Apache-2.0
"""``GradAccumLrSchedulerByStep``: step a learning-rate scheduler once per accumulation window."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from typing import Any

from stepforge.core import check_positive_int
from stepforge.core.torch_compat import LegacyLRScheduler

from ._window import AccumulatingOptimizer, AccumulationWarning, AccumulationWindow

__all__ = ["GradAccumLrSchedulerByStep"]


class GradAccumLrSchedulerByStep(LegacyLRScheduler):
    """Step the wrapped learning-rate scheduler once per accumulation window.

    Like ColossalAI's, it *is* a ``torch.optim.lr_scheduler._LRScheduler`` (ColossalAI's tests and trainers
    check ``isinstance(x, _LRScheduler)``) and so a ``LRScheduler`` (``SequentialLR``/``ChainedScheduler`` and
    checkpoint code see a scheduler), but it does not run ``LRScheduler.__init__``: that would step the wrapped
    optimizer's learning rate once more and patch its ``step``. What it does not define (``optimizer``,
    ``last_epoch``, ``base_lrs``...) is read from the wrapped scheduler.
    Standalone it counts calls: the inner scheduler steps on every ``accumulate_size``-th call (ColossalAI).
    Linked to an optimizer (``optimizer=`` or through :func:`accumulate_gradient`) it steps once for each
    window the optimizer closed, so a short tail window counts as one step. Stepping the *inner* scheduler
    directly (per micro-batch) is reported.
    """

    def __init__(
        self,
        lr_scheduler: Any,
        accumulate_size: int,
        *,
        optimizer: Any = None,
    ) -> None:
        if not callable(getattr(lr_scheduler, "step", None)):
            raise TypeError(
                "GradAccumLrSchedulerByStep: lr_scheduler must be a learning-rate scheduler with step() "
                f"(a torch.optim.lr_scheduler.LRScheduler), got {type(lr_scheduler).__name__}."
            )
        self.lr_scheduler = lr_scheduler
        self.accumulate_size = check_positive_int(
            "accumulate_size", accumulate_size, owner="GradAccumLrSchedulerByStep"
        )
        self.accumulate_step = 0
        if optimizer is not None and not isinstance(optimizer, AccumulatingOptimizer):
            raise TypeError(
                "GradAccumLrSchedulerByStep: optimizer must be a GradAccumOptimizer or OptimWrapper (an "
                f"AccumulatingOptimizer with a window), got {type(optimizer).__name__}; pass optimizer=None to "
                "count calls instead."
            )
        self._window: AccumulationWindow | None = None if optimizer is None else optimizer.window
        self._seen_steps = self._window.steps if self._window is not None else 0
        self._expected_epoch = getattr(lr_scheduler, "last_epoch", None)
        self._warned = False

    @staticmethod
    def compute_effective_steps_per_epoch(dataloader: Iterable[Any], accumulate_size: int) -> int:
        """Optimizer steps per epoch of a dropping :class:`GradAccumDataloader` (ColossalAI helper)."""
        return len(dataloader) // accumulate_size  # type: ignore[arg-type]

    def _check_inner(self) -> None:
        epoch = getattr(self.lr_scheduler, "last_epoch", None)
        if self._expected_epoch is not None and epoch != self._expected_epoch and not self._warned:
            self._warned = True
            warnings.warn(
                f"GradAccumLrSchedulerByStep: the wrapped {type(self.lr_scheduler).__name__} was stepped "
                f"outside the wrapper (last_epoch {self._expected_epoch} -> {epoch}); stepping it per "
                "micro-batch makes the schedule run accumulate_size times too fast. Step only the wrapper.",
                AccumulationWarning,
                stacklevel=3,
            )

    def _step_inner(self, *args: Any, **kwargs: Any) -> None:
        self.lr_scheduler.step(*args, **kwargs)
        self._expected_epoch = getattr(self.lr_scheduler, "last_epoch", None)

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Call once per micro-batch (after ``optimizer.step()``)."""
        self._check_inner()
        if self._window is not None:
            if self._window.steps > self._seen_steps:
                self._seen_steps = self._window.steps
                self._step_inner(*args, **kwargs)
            return
        self.accumulate_step += 1
        if self.accumulate_step >= self.accumulate_size:
            self.accumulate_step = 0
            self._step_inner(*args, **kwargs)

    def get_lr(self) -> Any:
        return self.lr_scheduler.get_lr()

    def get_last_lr(self) -> Any:
        return self.lr_scheduler.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        """The inner scheduler's state plus this wrapper's counters (ColossalAI saves no counter)."""
        return {
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "accumulate_step": self.accumulate_step,
            "seen_steps": self._seen_steps,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        if "lr_scheduler" not in state_dict:  # a bare inner state dict (ColossalAI layout)
            self.lr_scheduler.load_state_dict(dict(state_dict))
        else:
            self.lr_scheduler.load_state_dict(state_dict["lr_scheduler"])
            self.accumulate_step = int(state_dict.get("accumulate_step", 0))
            self._seen_steps = int(state_dict.get("seen_steps", self._seen_steps))
        self._expected_epoch = getattr(self.lr_scheduler, "last_epoch", None)

    def __getattr__(self, name: str) -> Any:
        if name == "lr_scheduler":
            raise AttributeError(name)
        return getattr(self.lr_scheduler, name)
