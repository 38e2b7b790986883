# SPDX-License-Identifier: Apache-2.0
"""mmengine-compatible ``OptimWrapper`` with exact, weighted and checkpointable gradient accumulation.

Same surface and semantics as ``mmengine.optim.OptimWrapper`` (divisors, partial last window,
``should_update``/``should_sync``, ``optim_context``, ``clip_grad``, ``base_param_settings``), plus: the exact
mean over the window's items on all ranks (``num_items``), the counters in ``state_dict()``, ``optim_context``
through :func:`stepforge.core.no_sync` (DDP, FSDP2 and ZeRO optimizers), and misuse reported (the package
README lists each case).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import nn

from stepforge.core import BackwardOptimizer
from stepforge.core.torch_compat import is_norm_with_running_stats

from ._clip import clip_grad_norm, clip_grad_value, parse_clip_grad
from ._window import AccumulationWindow, suspend_sync

__all__ = ["OptimWrapper"]

logger = logging.getLogger("stepforge.accum")


class OptimWrapper:
    """Wrap an optimizer to accumulate gradients, clip them and step at window boundaries.

    ``accumulative_counts``: micro-batches per optimizer step. ``clip_grad``: ``None``,
    ``dict(type="norm", max_norm=..., ...)`` (the arguments of ``torch.nn.utils.clip_grad_norm_``; ``type``
    defaults to ``"norm"``) or ``dict(type="value", clip_value=...)``. ``process_group``/``reduce_weights``: the
    ranks over which weighted mode sums ``num_items`` (pass ``reduce_weights=False`` if the gradients are not
    averaged across ranks). ``scheduler_clock``: ``"micro"`` (mmengine: schedulers step every micro-batch) or
    ``"window"`` (warn when the learning rate changes inside a window).

    Example::

        wrapper = OptimWrapper(torch.optim.AdamW(model.parameters()), accumulative_counts=4,
                               clip_grad=dict(max_norm=1.0))
        for batch in loader:
            with wrapper.optim_context(ddp_model):        # forward *inside*: DDP decides there
                loss = ddp_model(batch).mean()
            wrapper.update_params(loss, num_items=batch.numel())

    Extending: a subclass overrides the hooks :meth:`run_backward`, :meth:`before_clip`,
    :meth:`clip_gradients`, :meth:`optimizer_step` and :meth:`no_sync_context` (not ``backward``/``step``), and
    reads :attr:`window`, :attr:`clip_type` and :attr:`context_model`; see the package README.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        accumulative_counts: int = 1,
        clip_grad: dict[str, Any] | None = None,
        *,
        process_group: Any = None,
        reduce_weights: bool | None = None,
        scheduler_clock: str = "micro",
    ) -> None:
        if not hasattr(optimizer, "param_groups") or not hasattr(optimizer, "step"):
            raise TypeError(
                f"OptimWrapper: optimizer must be a torch.optim.Optimizer (or have param_groups and step), "
                f"got {type(optimizer).__name__}."
            )
        self.optimizer = optimizer
        self._window = AccumulationWindow(
            accumulative_counts,
            owner="OptimWrapper",
            process_group=process_group,
            reduce_weights=reduce_weights,
            scheduler_clock=scheduler_clock,
        )
        clip = parse_clip_grad(clip_grad, owner="OptimWrapper")
        self._clip_type: str | None = clip[0] if clip is not None else None
        self.clip_grad_kwargs: dict[str, Any] | None = clip[1] if clip is not None else None
        self.grad_norm: torch.Tensor | None = None  # last norm from clip_grad type 'norm'
        self._context_model: Any = None
        self.base_param_settings: dict[str, Any] | None = None
        if len(optimizer.param_groups) > 1:
            # mmengine: a fake group carrying the optimizer defaults, so schedulers track a "base" lr too
            defaults = getattr(optimizer, "defaults", {})
            self.base_param_settings = {"params": torch.tensor([0.0], dtype=torch.float), **defaults}

    # -- the training step --------------------------------------------------------------------------------
    def update_params(
        self,
        loss: torch.Tensor,
        step_kwargs: dict[str, Any] | None = None,
        zero_kwargs: dict[str, Any] | None = None,
        *,
        num_items: float | torch.Tensor | None = None,
    ) -> None:
        """Backward ``loss`` and, at a window boundary, step and zero the gradients.

        Args:
            loss: the micro-batch loss (a mean over its items when ``num_items`` is given).
            step_kwargs: passed to ``optimizer.step``.
            zero_kwargs: passed to ``optimizer.zero_grad``.
            num_items: the number of items (tokens, samples) ``loss`` averages over. Given on every
                micro-batch of a window, the window's gradient is that of the mean over all its items on all
                ranks; omitted, the loss is divided by the window length as in mmengine.
        """
        if num_items is None:
            loss = self.scale_loss(loss)
            self.backward(loss)
        else:
            self.backward(loss, weight=num_items)
        if self.should_update():
            self.step(**(step_kwargs or {}))
            self.zero_grad(**(zero_kwargs or {}))

    def backward(
        self, loss: torch.Tensor, *, weight: float | torch.Tensor | None = None, **kwargs: Any
    ) -> None:
        """Count the micro-batch and backward ``loss`` through :meth:`run_backward` (``**kwargs`` go there):
        weighted by ``weight`` (its item count, see :meth:`update_params`), else already divided by
        :meth:`scale_loss`."""
        w = self._window.before_backward(weight, self.optimizer, (self._context_model, self.optimizer))
        if w is not None:
            loss = loss * (w.to(loss.dtype) if isinstance(w, torch.Tensor) else w)
        self.run_backward(loss, **kwargs)
        self._window.after_backward(w)

    def step(self, **kwargs: Any) -> Any:
        """Normalise a weighted window, then :meth:`before_clip` and :meth:`clip_gradients` if ``clip_grad``
        is set, then :meth:`optimizer_step` (``**kwargs`` go there); the next backward opens a new window."""
        self._window.finalize(self.optimizer)
        if self.clip_grad_kwargs is not None:
            self.before_clip()
            norm = self.clip_gradients()
            if norm is not None:
                self.grad_norm = norm
        out = self.optimizer_step(**kwargs)
        self._window.close()
        return out

    def zero_grad(self, **kwargs: Any) -> None:
        """``optimizer.zero_grad(**kwargs)``."""
        self.optimizer.zero_grad(**kwargs)

    # -- extension hooks (the package README, "Extending OptimWrapper"): a subclass overrides these rather than
    # backward/step/optim_context, so that counting, weighting and the checkpointed counters stay in one place.
    def run_backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Hook: backpropagate ``loss`` (already divided or weighted for the window): through the optimizer when
        it is a :class:`stepforge.core.BackwardOptimizer` (AMP and ZeRO optimizers scale or reduce there)."""
        if isinstance(self.optimizer, BackwardOptimizer):
            self.optimizer.backward(loss, **kwargs)
        else:
            loss.backward(**kwargs)

    def before_clip(self) -> None:
        """Hook: called at a step (after weighted normalisation) before :meth:`clip_gradients`, only when
        ``clip_grad`` is set (an AMP subclass unscales here). Default: nothing."""

    def clip_gradients(self) -> torch.Tensor | None:
        """Hook: clip the window's gradients as ``clip_grad`` says; returns the total norm (stored in
        ``grad_norm``), ``None`` for value clipping or when nothing has a gradient. Default: the optimizer's own
        ``clip_grad_norm_`` when it is a :class:`stepforge.core.ClippingOptimizer`, else torch's."""
        assert self.clip_grad_kwargs is not None
        if self._clip_type == "value":
            clip_grad_value(self.optimizer, **self.clip_grad_kwargs)
            return None
        total: torch.Tensor | None = clip_grad_norm(self.optimizer, **self.clip_grad_kwargs)
        return total

    def optimizer_step(self, **kwargs: Any) -> Any:
        """Hook: step the optimizer at a window boundary (``optimizer.step(**kwargs)``); returns its result (an
        AMP subclass runs ``scaler.step(optimizer)`` and ``scaler.update()`` here)."""
        return self.optimizer.step(**kwargs)

    def no_sync_context(self, model: Any) -> AbstractContextManager[Any] | None:
        """Hook: the context that suspends gradient synchronisation of ``model`` and the optimizer.

        :meth:`optim_context` calls it only for a micro-batch that does not end the window (and not inside
        another ``optim_context``); ``None``: nothing can skip synchronisation. Default: :func:`suspend_sync`
        (it also watches a DDP model's forwards: one outside ``optim_context`` is reported).
        """
        return suspend_sync(model, self.optimizer)

    # -- what extensions read ------------------------------------------------------------------------------
    @property
    def window(self) -> AccumulationWindow:
        """The accumulation window (read it, do not drive it); :meth:`state_dict` saves its state under
        ``"accumulation"``."""
        return self._window

    @property
    def clip_type(self) -> str | None:
        """``"norm"`` or ``"value"`` (the ``type`` of ``clip_grad``), ``None`` without clipping."""
        return self._clip_type

    @property
    def context_model(self) -> Any:
        """The model given to the latest :meth:`optim_context` (``None`` before the first)."""
        return self._context_model

    # -- accumulation status -------------------------------------------------------------------------------
    @property
    def accumulative_counts(self) -> int:
        return self._window.counts

    @property
    def inner_count(self) -> int:
        """Micro-batches backwarded so far (global across epochs)."""
        return self._window.inner_count

    @property
    def max_counts(self) -> int:
        return self._window.max_counts

    def should_update(self) -> bool:
        """After a backward: whether this micro-batch ends the window (time to step)."""
        return self._window.should_update()

    def should_sync(self) -> bool:
        """Before a backward: whether the coming micro-batch ends the window (gradients synchronise)."""
        return self._window.should_sync()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` divided by the length of its window (mmengine: ``counts``, or the remainder of the last
        partial window once :meth:`initialize_count_status` gave ``max_counts``)."""
        return loss / self._window.divisor()

    def initialize_count_status(self, model: nn.Module, init_counts: int, max_counts: int) -> None:
        """Set the counter (e.g. the resumed iteration) and the total number of micro-batches of the run, which
        makes the last window partial (counts 3, max 10: steps after micro-batches 3, 6, 9 and 10)."""
        self._window.set_count_status(init_counts, max_counts)
        if init_counts % self.accumulative_counts != 0:
            self._window.warn_once(
                "init-mid-window",
                f"OptimWrapper: init_counts={init_counts} is not a multiple of accumulative_counts="
                f"{self.accumulative_counts}: training resumes in the middle of a window whose first "
                f"{init_counts % self.accumulative_counts} micro-batch(es) of gradient were not checkpointed; "
                "that window's step misses them. Checkpoint at window boundaries.",
            )
        modules = model.modules() if isinstance(model, nn.Module) else ()
        if self.accumulative_counts > 1 and any(is_norm_with_running_stats(m) for m in modules):
            logger.warning(
                "Gradient accumulation may slightly change results: the model has BatchNorm layers, whose "
                "statistics see micro-batches, not the accumulated batch."
            )

    @contextmanager
    def optim_context(self, model: Any) -> Iterator[None]:
        """Run the forward (it must be inside: DDP decides at forward time) and backward of a micro-batch; unless
        it ends the window, the gradient sync of ``model`` and the optimizer is suspended (:meth:`no_sync_context`).
        """
        self._context_model = model
        with self._window.micro_batch_context(lambda: self.no_sync_context(model)):
            yield

    # -- optimizer surface ---------------------------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's groups, plus the base-settings group when there are several (as mmengine)."""
        if self.base_param_settings is not None:
            return [*self.optimizer.param_groups, self.base_param_settings]
        return self.optimizer.param_groups

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    def get_lr(self) -> dict[str, list[float]]:
        """``{'lr': [per group]}``, plus ``'base_lr'`` with several groups."""
        res: dict[str, list[float]] = {}
        if self.base_param_settings is not None:
            res["base_lr"] = [self.base_param_settings["lr"]]
        res["lr"] = [group["lr"] for group in self.optimizer.param_groups]
        return res

    def get_momentum(self) -> dict[str, list[float]]:
        """``{'momentum': [per group]}``: ``momentum``, else ``betas[0]``, else 0."""
        momentum = []
        for group in self.optimizer.param_groups:
            if "momentum" in group:
                momentum.append(group["momentum"])
            elif "betas" in group:
                momentum.append(group["betas"][0])
            else:
                momentum.append(0)
        return {"momentum": momentum}

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state dict, plus ``base_param_settings`` and the ``accumulation`` counters."""
        state = self.optimizer.state_dict()
        if self.base_param_settings is not None:
            state["base_param_settings"] = self.base_param_settings
        state["accumulation"] = self._window.state_dict()
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load what :meth:`state_dict` returned (an mmengine state dict without counters loads too)."""
        state = dict(state_dict)  # mmengine pops from the caller's dict; we do not
        base = state.pop("base_param_settings", None)
        accumulation = state.pop("accumulation", None)
        if base is not None:
            self.base_param_settings = base
        self.optimizer.load_state_dict(state)
        if accumulation is not None:
            self._window.load_state_dict(accumulation)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(optimizer={type(self.optimizer).__name__}, accumulative_counts="
            f"{self.accumulative_counts}, clip_grad={self.clip_grad_kwargs!r}, inner_count={self.inner_count})"
        )
