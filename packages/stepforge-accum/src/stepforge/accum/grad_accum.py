# SPDX-License-Identifier: Apache-2.0
"""ColossalAI's ``colossalai.utils.gradient_accumulation`` API, exact and checkpointable.

Same names and arguments as ColossalAI (``accumulate_gradient``, ``GradAccumDataloader``,
``GradAccumOptimizer``, ``GradAccumLrSchedulerByStep``, ``GradAccumGradientHandler``). Differences:

- ``GradAccumDataloader(..., drop_last=False)`` keeps each epoch's tail as a short window, divided by its own
  length and stepped at the end of the epoch (ColossalAI always drops it; that remains the default);
- ``GradAccumOptimizer.optim_context()`` suspends DDP/FSDP2/ZeRO synchronisation around the *forward* and
  backward of non-final micro-batches, and a backward-only use with DDP is reported;
- ``backward(loss, weight=n)`` gives the exact window mean over items (tokens, samples) across ranks;
- the scheduler and gradient-handler wrappers built by :func:`accumulate_gradient` follow the optimizer's
  windows (so a short tail window counts as one step), and every wrapper's ``state_dict`` has its counters.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from stepforge.core import BackwardOptimizer, GradientHandler, check_positive_int

from ._clip import check_max_norm, check_norm_type, clip_grad_norm
from ._window import AccumulatingOptimizer, AccumulationWindow, track_forward
from .lr_scheduler import GradAccumLrSchedulerByStep

__all__ = [
    "accumulate_gradient",
    "GradAccumDataloader",
    "GradAccumOptimizer",
    "GradAccumLrSchedulerByStep",
    "GradAccumGradientHandler",
]


class GradAccumOptimizer:
    """Step the wrapped optimizer once every ``accumulate_size`` backward calls.

    ``model``: the (DDP / FSDP2) model whose gradient synchronisation is suspended inside a window;
    ``process_group``/``reduce_weights``: as for :class:`stepforge.accum.OptimWrapper` (weighted mode). Use::

        for x, y in dataloader:
            optimizer.zero_grad()                 # acts only at the start of a window
            with optimizer.optim_context():       # the forward must be inside for DDP
                loss = criterion(model(x), y)
                optimizer.backward(loss)          # divided by the window length
            optimizer.step()                      # steps only at the end of a window
    """

    def __init__(
        self,
        optim: torch.optim.Optimizer,
        accumulate_size: int,
        model: nn.Module | None = None,
        *,
        process_group: Any = None,
        reduce_weights: bool | None = None,
    ) -> None:
        self.optim = optim
        self.model = model
        track_forward(model)
        self._window = AccumulationWindow(
            accumulate_size,
            owner="GradAccumOptimizer",
            count_name="accumulate_size",
            process_group=process_group,
            reduce_weights=reduce_weights,
            scheduler_clock="window",
        )

    @property
    def accumulate_size(self) -> int:
        return self._window.counts

    @property
    def window(self) -> AccumulationWindow:
        """The accumulation window (counters, boundaries; see :class:`AccumulationWindow`). Read-only."""
        return self._window

    @property
    def accumulate_step(self) -> int:
        """Backward calls in the current window (0 right after a step), as ColossalAI."""
        return self._window.position

    def _targets(self) -> tuple[Any, ...]:
        return (self.model, self.optim)

    @contextmanager
    def optim_context(self) -> Iterator[None]:
        """Suspend gradient synchronisation for the forward and backward of a non-final micro-batch."""
        with self._window.sync_context(*self._targets()):
            yield

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        """Zero the gradients only at the start of a window (ColossalAI semantics)."""
        if self._window.position == 0:
            self.optim.zero_grad(*args, **kwargs)

    def backward(self, loss: torch.Tensor, *, weight: float | torch.Tensor | None = None) -> None:
        """Backward ``loss / window length`` (or ``loss * weight`` in weighted mode) and count it; through the
        optimizer when it is a :class:`stepforge.core.BackwardOptimizer` (AMP scales the loss, ZeRO reduces)."""
        w = self._window.before_backward(weight, self.optim, self._targets())
        if w is None:
            loss = loss / self._window.divisor()
        else:
            loss = loss * (w.to(loss.dtype) if isinstance(w, torch.Tensor) else w)
        optim = self.optim
        self._run_backward(
            w, lambda: optim.backward(loss) if isinstance(optim, BackwardOptimizer) else loss.backward()
        )

    def backward_by_grad(self, tensor: torch.Tensor, grad: torch.Tensor) -> None:
        """Backward from ``tensor`` with output gradient ``grad`` (which must carry the 1/window-length factor,
        as in ColossalAI) and count it; through a :class:`stepforge.core.BackwardOptimizer` as :meth:`backward`."""
        self._window.before_backward(None, self.optim, self._targets())
        optim = self.optim
        if isinstance(optim, BackwardOptimizer):
            self._run_backward(None, lambda: optim.backward_by_grad(tensor, grad))
        else:
            self._run_backward(None, lambda: torch.autograd.backward(tensor, grad))

    def _run_backward(self, w: Any, run: Any) -> None:  # after the window's before_backward
        if self._window.context_depth == 0 and not self._window.should_sync():
            # ColossalAI wraps the backward; enough for FSDP2 and ZeRO, not for DDP (warned above)
            with self._window.sync_context(*self._targets()):
                run()
        else:
            run()
        self._window.after_backward(w)

    def _at_boundary(self) -> bool:
        return self._window.position > 0 and self._window.should_update()

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """Step (and return its result) only when the window is complete; otherwise return ``None``."""
        if not self._at_boundary():
            return None
        self._window.finalize(self.optim)
        out = self.optim.step(*args, **kwargs)
        self._window.close()
        return out

    def clip_grad_norm(self, model: nn.Module | None, max_norm: float, norm_type: float = 2.0) -> Any:
        """Clip by the global norm only at the end of a window (after weighted normalisation), through the
        optimizer when it is a :class:`stepforge.core.ClippingOptimizer` (AMP unscales, ZeRO reduces); returns
        the total norm, or ``None`` inside a window. ``max_norm``/``norm_type`` <= 0: a HyperParameterError."""
        max_norm = check_max_norm(max_norm, owner="GradAccumOptimizer.clip_grad_norm")
        norm_type = check_norm_type(norm_type, owner="GradAccumOptimizer.clip_grad_norm")
        if not self._at_boundary():
            return None
        self._window.finalize(self.optim)
        return clip_grad_norm(self.optim, max_norm, norm_type)

    def clip_grad_by_norm(self, max_norm: float, norm_type: float = 2.0) -> Any:
        """ColossalAI ``OptimizerWrapper`` spelling of :meth:`clip_grad_norm` (with this wrapper's model)."""
        return self.clip_grad_norm(self.model, max_norm, norm_type)

    def state_dict(self) -> dict[str, Any]:
        state = self.optim.state_dict()
        state["accumulation"] = self._window.state_dict()
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        state = dict(state_dict)
        accumulation = state.pop("accumulation", None)
        self.optim.load_state_dict(state)
        if accumulation is not None:
            self._window.load_state_dict(accumulation)

    def __getattr__(self, name: str) -> Any:  # param_groups, state, defaults...: the wrapped optimizer's
        if name in ("optim", "_window", "model"):  # not yet set (unpickling)
            raise AttributeError(name)
        return getattr(self.optim, name)


class GradAccumDataloader:
    """Iterate a data loader in whole accumulation windows.

    ``dataloader`` must have a ``len()`` (to know where the tail starts). ``drop_last=True`` (ColossalAI): yield
    ``len - len % accumulate_size`` batches per epoch (a loader that is not a ``torch.utils.data.DataLoader``,
    DALI..., is drained of its tail so its next epoch starts clean); ``False``: yield every batch and, linked to
    a :class:`GradAccumOptimizer` (``optimizer=``, as :func:`accumulate_gradient` does), make the tail a short
    window with its own divisor and step.
    """

    def __init__(
        self,
        dataloader: Iterable[Any],
        accumulate_size: int,
        *,
        drop_last: bool = True,
        optimizer: GradAccumOptimizer | None = None,
    ) -> None:
        self.dataloader = dataloader
        self.accumulate_size = check_positive_int(
            "accumulate_size", accumulate_size, owner="GradAccumDataloader"
        )
        self.drop_last = bool(drop_last)
        self.optimizer = optimizer
        self.consume_remain_data = not isinstance(dataloader, torch.utils.data.DataLoader)
        self._cur_step = 0
        self._skip = 0
        self._dataiter: Iterator[Any] | None = None

    def _length(self) -> int:
        try:
            return len(self.dataloader)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(
                f"GradAccumDataloader needs a sized data loader to find each epoch's tail; "
                f"{type(self.dataloader).__name__} has no len()."
            ) from None

    @property
    def steps_per_epoch(self) -> int:
        n = self._length()
        return n - n % self.accumulate_size if self.drop_last else n

    def __len__(self) -> int:
        return self.steps_per_epoch

    def __iter__(self) -> GradAccumDataloader:
        self._dataiter = iter(self.dataloader)
        steps = self.steps_per_epoch
        if self.optimizer is not None:
            # Windows start with the epoch; without drop_last the epoch's end is a window boundary.
            self.optimizer.window.start_epoch(steps - self._skip if not self.drop_last else 0)
        self._cur_step = 0
        for _ in range(self._skip):  # resuming mid-epoch without a stateful inner loader: replay
            next(self._dataiter)
            self._cur_step += 1
        self._skip = 0
        return self

    def __next__(self) -> Any:
        if self._dataiter is None:
            raise TypeError("GradAccumDataloader: call iter() first")
        if self._cur_step >= self.steps_per_epoch:
            raise StopIteration
        self._cur_step += 1
        data = next(self._dataiter)
        if self._cur_step == self.steps_per_epoch and self.consume_remain_data:
            for _ in self._dataiter:  # drain non-standard loaders (DALI) so their next epoch starts clean
                pass
        return data

    def __getattr__(self, name: str) -> Any:
        if name == "dataloader":
            raise AttributeError(name)
        return getattr(self.dataloader, name)

    def state_dict(self) -> dict[str, Any]:
        """Position in the epoch, plus the inner loader's state when it has one."""
        state: dict[str, Any] = {"cur_step": self._cur_step, "drop_last": self.drop_last}
        inner = getattr(self.dataloader, "state_dict", None)
        if callable(inner):
            state["dataloader"] = inner()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at the saved position: the inner loader's own state if it has one, else by replaying."""
        cur = int(state["cur_step"])
        inner = getattr(self.dataloader, "load_state_dict", None)
        if "dataloader" in state and callable(inner):
            inner(state["dataloader"])
            self._skip = 0
        else:
            self._skip = cur
        self._cur_step = cur


class GradAccumGradientHandler:
    """Run the wrapped gradient handler (e.g. a data-parallel all-reduce) only at window boundaries.

    Standalone it counts calls (every ``accumulate_size``-th runs the handler, ColossalAI); linked to an
    optimizer it runs when the last backward ended a window (tail windows included). Call it after backward.
    """

    def __init__(self, grad_handler: Any, accumulate_size: int, *, optimizer: Any = None) -> None:
        if not isinstance(grad_handler, GradientHandler):
            raise TypeError(
                f"GradAccumGradientHandler: grad_handler must have handle_gradient(), got "
                f"{type(grad_handler).__name__}."
            )
        self.grad_handler = grad_handler
        self.accumulate_size = check_positive_int(
            "accumulate_size", accumulate_size, owner="GradAccumGradientHandler"
        )
        self.accumulate_step = 0
        self._window = optimizer.window if isinstance(optimizer, AccumulatingOptimizer) else None

    def handle_gradient(self) -> None:
        if self._window is not None:
            if self._window.position > 0 and self._window.should_update():
                self.grad_handler.handle_gradient()
            return
        self.accumulate_step += 1
        if self.accumulate_step >= self.accumulate_size:
            self.accumulate_step = 0
            self.grad_handler.handle_gradient()

    def state_dict(self) -> dict[str, Any]:
        return {"accumulate_step": self.accumulate_step}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.accumulate_step = int(state_dict["accumulate_step"])


def accumulate_gradient(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    dataloader: Iterable[Any],
    accumulate_size: int,
    gradient_handlers: list[Any] | None = None,
    lr_scheduler: Any = None,
    *,
    drop_last: bool = True,
) -> tuple[GradAccumOptimizer, GradAccumDataloader, list[GradAccumGradientHandler] | None, Any]:
    """Wrap the four training objects for accumulation over ``accumulate_size`` micro-batches.

    Returns ``(optimizer, dataloader, gradient_handlers, lr_scheduler)`` as ColossalAI; the wrappers share
    the optimizer's window, so handlers and scheduler act at its boundaries (epoch tails included when
    ``drop_last=False``).
    """
    optim = GradAccumOptimizer(optimizer, accumulate_size=accumulate_size, model=model)
    loader = GradAccumDataloader(dataloader, accumulate_size, drop_last=drop_last, optimizer=optim)
    handlers = None
    if gradient_handlers is not None:
        handlers = [GradAccumGradientHandler(h, accumulate_size, optimizer=optim) for h in gradient_handlers]
    sched = None
    if lr_scheduler is not None:
        sched = GradAccumLrSchedulerByStep(lr_scheduler, accumulate_size, optimizer=optim)
    return optim, loader, handlers, sched
