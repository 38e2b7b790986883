# SPDX-License-Identifier: Apache-2.0
"""The accumulation window: one counter, boundary and normalisation logic shared by both APIs.

Micro-batches are numbered by ``inner_count`` (backward calls so far, global across epochs). A micro-batch
number ``n`` (1-based, counted after its backward) *ends a window* when

- ``(n - offset) % counts == 0`` (full windows; ``offset`` is 0 unless a data loader realigned the windows at
  an epoch start),
- or ``n == max_counts`` (mmengine's last partial window of the run),
- or ``n == epoch_end`` (the short tail window of an epoch kept by ``GradAccumDataloader(drop_last=False)``).

The divisor of a micro-batch is the length of the window it belongs to, measured from the previous boundary:
``counts`` for full windows, the remainder for the partial last window, and ``counts`` too when training
resumed in the middle of a window (the missing micro-batches count as zero gradients, as in mmengine).

Weighted mode: ``backward(loss, weight=w)`` backpropagates ``loss * w`` (``loss`` is the micro-batch *mean*,
``w`` its number of tokens or samples) and the window's gradient is multiplied by ``W / N`` at the step, where
``N`` is the sum of ``w`` over the window and over the ``W`` data-parallel ranks (one all-reduce of one float64
per window, launched before the last backward so that it overlaps with it). Since DDP, FSDP2 and ZeRO average
gradients over the ``W`` ranks, the result is exactly the gradient of the mean loss over every item of the
window on every rank.
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from stepforge.core import (
    GradScalingOptimizer,
    HyperParameterError,
    StepforgeError,
    check_positive_int,
    no_sync,
    supports_no_sync,
)

from ._weights import WindowWeights, check_weight_value

__all__ = [
    "AccumulatingOptimizer",
    "AccumulationError",
    "AccumulationWarning",
    "AccumulationWindow",
    "scale_gradients",
    "track_forward",
]


def is_forward_armed(target: Any) -> bool:
    """Whether ``target`` decides at *forward* time if the next backward synchronises (DDP does)."""
    return isinstance(target, DistributedDataParallel)


def _record_sync_at_forward(module: nn.Module, args: Any) -> None:
    # DDP reads this flag in its forward to arm (or not) the all-reduce of the coming backward.
    # mypy types nn.Module attributes as Tensor | Module (from __getattr__); this one is our bool flag.
    armed = bool(torch.is_grad_enabled() and module.require_backward_grad_sync)
    module._stepforge_armed = armed  # type: ignore[assignment]


def track_forward(target: Any) -> None:
    """Remember, at each forward of a DDP model, whether its next backward will all-reduce (once per model): how
    a "no_sync around the backward only" mistake is detected."""
    if is_forward_armed(target) and getattr(target, "_stepforge_forward_hook", None) is None:
        target._stepforge_forward_hook = target.register_forward_pre_hook(_record_sync_at_forward)


def scale_gradients(optimizer: Any, factor: float) -> None:
    """Multiply every gradient ``optimizer`` will step with by ``factor`` (weighted-mode normalisation).

    A :class:`stepforge.core.GradScalingOptimizer` (a ZeRO-2 optimizer holding reduced pieces) scales its own.
    """
    if factor == 1.0:
        return
    if isinstance(optimizer, GradScalingOptimizer):
        optimizer.scale_grads_(factor)
        return
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not grads:
        return
    try:
        torch._foreach_mul_(grads, factor)
    except (RuntimeError, TypeError, NotImplementedError):  # mixed devices, DTensor/sparse mixes
        for grad in grads:
            grad.mul_(factor)


def suspend_sync(*targets: Any) -> AbstractContextManager[Any] | None:
    """:func:`stepforge.core.no_sync` over those ``targets`` that support it (``None`` when none does); DDP
    models among them start having their forwards watched (:func:`track_forward`)."""
    live = [t for t in targets if supports_no_sync(t)]
    for t in live:
        track_forward(t)
    return no_sync(*live) if live else None


class AccumulationError(StepforgeError, RuntimeError):
    """Gradient accumulation was used in a way that would give a wrong gradient."""


class AccumulationWarning(UserWarning):
    """Gradient accumulation is used in a way that wastes communication or loses gradients."""


class AccumulationWindow:
    """Counter, boundaries, divisors and window weights of one accumulating optimizer.

    ``counts``: micro-batches per window; ``owner``: the name in messages; ``process_group``/``reduce_weights``:
    see :class:`WindowWeights`; ``scheduler_clock="window"``: a learning rate that changes inside a window means
    a scheduler is stepped per micro-batch (warn; ``"micro"``, mmengine's convention, expects it).

    ``OptimWrapper.window`` and ``GradAccumOptimizer.window`` return it; extensions and checkpoints read it
    (the package README, "Extending OptimWrapper"), the wrappers alone change it. :meth:`load_state_dict`
    restores ``position`` and the open window's weight, so a checkpoint taken mid-window resumes counting where
    it stopped (the gradients themselves are the caller's).
    """

    def __init__(
        self,
        counts: Any,
        *,
        owner: str,
        count_name: str = "accumulative_counts",
        process_group: Any = None,
        reduce_weights: bool | None = None,
        scheduler_clock: str = "micro",
    ) -> None:
        self.owner = owner
        self.counts = check_positive_int(count_name, counts, owner=owner)  # micro-batches per window
        if scheduler_clock not in ("micro", "window"):
            raise HyperParameterError(
                f"{owner}: invalid scheduler_clock={scheduler_clock!r}; use 'micro' (schedulers step every "
                "micro-batch, as in mmengine) or 'window' (schedulers step once per optimizer step)."
            )
        self.scheduler_clock = scheduler_clock
        self._weights = WindowWeights(process_group, reduce_weights)
        self.inner_count = 0  # micro-batches backwarded so far, global across epochs
        self.max_counts = -1  # -1: unknown
        self.offset = 0
        self.epoch_end: int | None = None
        self.position = 0  # backward calls since the last step (ColossalAI's ``accumulate_step``)
        self.steps = 0  # windows closed by an optimizer step
        self.weighted: bool | None = None  # mode of the open window (None: no backward yet)
        self._finalized = False
        self._lr_snapshot: tuple[Any, ...] | None = None
        self._warned: set[str] = set()
        self._context_depth = 0

    def is_boundary(self, n: int) -> bool:
        """Whether micro-batch ``n`` (1-based) ends a window."""
        if n <= 0:
            return False
        return (n - self.offset) % self.counts == 0 or n == self.max_counts or n == self.epoch_end

    def _prev_boundary(self, n: int) -> int:  # the last boundary <= n (0 counts as one)
        cands = [0, self.offset + ((n - self.offset) // self.counts) * self.counts]
        cands += [b for b in (self.max_counts, self.epoch_end) if b is not None and 0 < b <= n]
        return max(c for c in cands if c <= n)

    def _next_boundary(self, n: int) -> int:
        cands = [self.offset + ((n - self.offset) // self.counts + 1) * self.counts]
        cands += [b for b in (self.max_counts, self.epoch_end) if b is not None and b > n]
        return min(cands)

    def should_update(self) -> bool:
        """After a backward: does this micro-batch end the window (step now)?"""
        return self.is_boundary(self.inner_count)

    def should_sync(self) -> bool:
        """Before a backward: will the coming micro-batch end the window (synchronise gradients)?"""
        return self.is_boundary(self.inner_count + 1)

    def window_length(self) -> int:
        """Length of the window the coming micro-batch belongs to: its loss divisor."""
        return self._next_boundary(self.inner_count) - self._prev_boundary(self.inner_count)

    divisor = window_length

    def set_count_status(self, init_counts: Any, max_counts: Any) -> None:
        if isinstance(init_counts, bool) or not isinstance(init_counts, numbers.Integral) or init_counts < 0:
            raise HyperParameterError(
                f"{self.owner}: invalid init_counts={init_counts!r}; init_counts must be an int >= 0 (the "
                "number of micro-batches already trained)."
            )
        if (
            isinstance(max_counts, bool)
            or not isinstance(max_counts, numbers.Integral)
            or max_counts < -1
            or max_counts == 0
        ):
            raise HyperParameterError(
                f"{self.owner}: invalid max_counts={max_counts!r}; max_counts must be an int >= 1 (the number "
                "of micro-batches of the whole run, e.g. max_iters) or -1 when it is unknown."
            )
        if max_counts != -1 and init_counts > max_counts:
            raise HyperParameterError(
                f"{self.owner}: init_counts={init_counts} is past max_counts={max_counts}; init_counts is the "
                "number of micro-batches already trained (the resumed iteration) and cannot exceed the total."
            )
        if self.position:
            raise AccumulationError(
                f"{self.owner}: initialize_count_status() called with {self.position} micro-batch(es) "
                "accumulated and not stepped; call it before training or right after a step."
            )
        self.inner_count = int(init_counts)
        self.max_counts = int(max_counts)
        self.offset = 0
        self.epoch_end = None
        self._reset_window()

    def start_epoch(self, length: int) -> None:
        """Windows restart at the current micro-batch and the ``length``-th one from here ends a window."""
        if self.position:
            self.warn_once(
                "epoch-mid-window",
                f"{self.owner}: a new epoch starts with {self.position} micro-batch(es) accumulated and not "
                "stepped (the previous epoch was cut short); they join the first window of this epoch.",
            )
        self.offset = self.inner_count - self.position
        self.epoch_end = self.offset + length if length > 0 else None

    def check_weight(self, weight: Any) -> float | torch.Tensor | None:
        """Validate a micro-batch weight against the mode of the open window."""
        checked: float | torch.Tensor | None = check_weight_value(weight, owner=self.owner)
        mode = checked is not None
        if self.weighted is not None and self.weighted != mode and self.position:
            have = "with" if self.weighted else "without"
            raise AccumulationError(
                f"{self.owner}: this window started {have} weights (num_items/weight) and micro-batch "
                f"{self.position + 1} of it is {'with' if mode else 'without'}; pass num_items on every "
                "micro-batch of a window or on none."
            )
        return checked

    def before_backward(
        self, weight: Any, optimizer: Any, targets: Iterable[Any]
    ) -> float | torch.Tensor | None:
        """Checks and the overlapped weight all-reduce, before the micro-batch's backward; returns ``weight``
        checked (:meth:`check_weight`). ``targets``: the model and optimizer whose no-sync context should have
        held the forward of a non-final micro-batch (a DDP forward outside it armed the all-reduce anyway)."""
        checked: float | torch.Tensor | None = self.check_weight(weight)
        if not self.should_sync() and any(
            is_forward_armed(t) and getattr(t, "_stepforge_armed", False) for t in targets
        ):
            self.warn_once(
                "backward-only-no-sync",
                f"{self.owner}: the forward of micro-batch {self.position + 1} (not the last of its window) ran "
                "outside the no-sync context. DDP arms its gradient all-reduce in the forward, so this "
                "micro-batch is all-reduced anyway (correct, but k times the communication); wrapping only "
                "the backward does not help. Run the forward inside `with wrapper.optim_context(model):`.",
            )
        if self.scheduler_clock == "window":
            lrs = tuple(group.get("lr") for group in optimizer.param_groups)
            if self.position == 0 or self._lr_snapshot is None:
                self._lr_snapshot = lrs
            elif lrs != self._lr_snapshot:
                self.warn_once(
                    "lr-mid-window",
                    f"{self.owner}: the learning rate changed inside an accumulation window (from "
                    f"{list(self._lr_snapshot)} to {list(lrs)} at micro-batch {self.position + 1} of "
                    f"{self.window_length()}): a scheduler is stepped per micro-batch while this wrapper "
                    "counts windows. Step it once per optimizer step (GradAccumLrSchedulerByStep does), or "
                    "scale its milestones by the accumulation count.",
                )
                self._lr_snapshot = lrs
        if 0 < self.max_counts <= self.inner_count:
            self.warn_once(
                "past-max-counts",
                f"{self.owner}: micro-batch {self.inner_count + 1} is past max_counts={self.max_counts} given "
                "to initialize_count_status(). Training goes on in windows of accumulative_counts aligned to "
                "its multiples, each divided by its real length (mmengine divides by the remainder, or "
                "asserts when there is none). Pass the real total to initialize_count_status().",
            )
        if checked is not None and self.should_sync():
            self._weights.launch_reduce(extra=checked, micro_batch=self.inner_count + 1)
        return checked

    def after_backward(self, weight: float | torch.Tensor | None) -> None:
        self.weighted = weight is not None
        if weight is not None:
            self._weights.add(weight)
        self.inner_count += 1
        self.position += 1

    @property
    def context_depth(self) -> int:
        """How many micro-batch contexts (``optim_context`` / ``sync_context``) are open; 0 outside them."""
        return self._context_depth

    @contextmanager
    def micro_batch_context(
        self, suspend_sync: Callable[[], AbstractContextManager[Any] | None]
    ) -> Iterator[None]:
        """Run a micro-batch; if it does not end the window, inside the context ``suspend_sync()`` returns.

        ``suspend_sync`` is called only when the coming micro-batch is not the window's last and no outer
        micro-batch context is open (nested contexts neither suspend twice nor resume early); it returns a
        context manager that suspends gradient synchronisation, or ``None`` when nothing can skip it.
        """
        suspend = suspend_sync() if not self.should_sync() and self._context_depth == 0 else None
        self._context_depth += 1
        try:
            if suspend is not None:
                with suspend:
                    yield
            else:
                yield
        finally:
            self._context_depth -= 1

    def sync_context(self, *targets: Any) -> AbstractContextManager[None]:
        """:meth:`micro_batch_context` suspending ``targets`` through :func:`suspend_sync`."""
        return self.micro_batch_context(lambda: suspend_sync(*targets))

    def finalize(self, optimizer: Any) -> None:
        """Turn the accumulated weighted gradient into the window mean (times ``W / N``), once per window."""
        if self._finalized or not self.weighted or self.position == 0:
            return
        factor, total = self._weights.factor(self.inner_count)  # all-reduces N now if no backward launched it
        if total <= 0.0:
            self.warn_once(
                "zero-weight",
                f"{self.owner}: a window's num_items sum to {total:g} over all ranks; its gradient is zero.",
            )
        scale_gradients(optimizer, factor)
        self._finalized = True

    def close(self) -> None:
        """The optimizer stepped: the next backward opens a new window."""
        self.steps += 1
        self._reset_window()

    def _reset_window(self) -> None:
        self.position = 0
        self.weighted = None
        self._weights.reset()
        self._finalized = False
        self._lr_snapshot = None

    def warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, AccumulationWarning, stacklevel=4)

    def state_dict(self) -> dict[str, Any]:
        local = self._weights.local_sum()
        return {
            "counts": self.counts,
            "inner_count": self.inner_count,
            "max_counts": self.max_counts,
            "offset": self.offset,
            "epoch_end": self.epoch_end,
            "position": self.position,
            "steps": self.steps,
            "weighted": self.weighted,
            "window_weight": local,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        missing = {"inner_count", "position"} - set(state)
        if missing:
            raise AccumulationError(f"{self.owner}: accumulation state lacks {sorted(missing)}.")
        if int(state.get("counts", self.counts)) != self.counts:
            self.warn_once(
                "counts-changed",
                f"{self.owner}: the checkpoint was saved with {state['counts']} micro-batches per window and "
                f"this run uses {self.counts}; windows are realigned to the new count.",
            )
        self.inner_count = int(state["inner_count"])
        self.max_counts = int(state.get("max_counts", -1))
        self.offset = int(state.get("offset", 0))
        self.epoch_end = None if state.get("epoch_end") is None else int(state["epoch_end"])
        self.steps = int(state.get("steps", 0))
        self._reset_window()
        self.position = int(state["position"])
        self.weighted = state.get("weighted")
        self._weights.local = float(state.get("window_weight", 0.0))
        if self.position:
            self.warn_once(
                "resume-mid-window",
                f"{self.owner}: resuming in the middle of an accumulation window ({self.position} "
                f"micro-batch(es) of {self.window_length()} done). Their gradients are not in the optimizer "
                "state, so this window's step will miss them unless you restored the .grad tensors too. "
                "Save checkpoints right after a step (when should_update() was true).",
            )


@runtime_checkable
class AccumulatingOptimizer(Protocol):
    """An optimizer (wrapper) that steps once per accumulation window: ``OptimWrapper``, ``GradAccumOptimizer``
    and their subclasses. ``GradAccumLrSchedulerByStep(optimizer=...)`` counts the windows it closed."""

    @property
    def window(self) -> AccumulationWindow: ...
