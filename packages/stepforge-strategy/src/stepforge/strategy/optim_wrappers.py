# SPDX-License-Identifier: Apache-2.0
"""mmengine's ``ColossalAIOptimWrapper`` and ``AmpOptimWrapper`` on stepforge-accum's ``OptimWrapper``: they
only override its documented hooks (``run_backward``, ``before_clip``, ``optimizer_step``,
``no_sync_context``...)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch

from stepforge.accum import OptimWrapper
from stepforge.core import BoostedOptimizer

from ._env import is_distributed
from .booster import Booster

__all__ = ["ColossalAIOptimWrapper", "AmpOptimWrapper"]


class ColossalAIOptimWrapper(OptimWrapper):
    """Drive backward, ``no_sync`` and clipping through a :class:`~stepforge.strategy.Booster` (needed before
    ``backward``/``optim_context``); ``clip_grad`` (which mmengine refuses here) clips through the plugin
    after fp16 unscaling. It never enables autocast: the Booster's mixed precision did."""

    def __init__(
        self,
        optimizer: Any,
        booster: Booster | None = None,
        accumulative_counts: int = 1,
        clip_grad: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(optimizer, accumulative_counts=accumulative_counts, clip_grad=clip_grad, **kwargs)
        if booster is not None and not isinstance(booster, Booster):
            raise TypeError(
                f"ColossalAIOptimWrapper: booster must be a stepforge.strategy.Booster, got {type(booster).__name__}."
            )
        self.booster = booster

    def _require_booster(self, what: str) -> Booster:
        if self.booster is None:
            raise RuntimeError(
                f"ColossalAIOptimWrapper.{what}: no booster; build it with ColossalAIOptimWrapper(optimizer, "
                "booster=booster) or set wrapper.booster (Strategy.prepare does)."
            )
        return self.booster

    def run_backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """The boosted optimizer's ``backward(loss)`` (the plugin's loss scaling and reduction), under
        ``no_sync`` for a non-final micro-batch outside ``optim_context``."""
        self._require_booster("backward")
        if kwargs:
            raise TypeError(
                f"ColossalAIOptimWrapper.backward: the booster's backward takes no extra arguments, got "
                f"{sorted(kwargs)}."
            )
        if not isinstance(self.optimizer, BoostedOptimizer):
            raise TypeError(
                "ColossalAIOptimWrapper.backward: optimizer must be the boosted optimizer booster.boost() returned "
                f"(a stepforge.core.BoostedOptimizer), got {type(self.optimizer).__name__}."
            )
        model = self.context_model
        suspend = None
        if model is not None and self.window.context_depth == 0 and not self.should_sync():
            # mmengine runs only the forward inside optim_context; FSDP2 reads its sync flag in the backward,
            # so a non-final micro-batch's backward skips the reduce-scatter here too (DDP decided at forward).
            suspend = self.no_sync_context(model)
        with suspend if suspend is not None else nullcontext():
            self.optimizer.backward(loss)

    def no_sync_context(self, model: Any) -> AbstractContextManager[Any] | None:
        """``booster.no_sync(model, optimizer)`` when the plugin supports it, else ``None``."""
        booster = self._require_booster("optim_context")
        if not booster.supports_no_sync():
            return None
        return booster.no_sync(model, self.optimizer)

    @contextmanager
    def optim_context(self, model: Any) -> Iterator[None]:
        """Run a micro-batch's forward and backward; non-final ones skip gradient sync when the plugin can."""
        self._require_booster("optim_context")
        with super().optim_context(model):
            yield


_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}


class AmpOptimWrapper(OptimWrapper):
    """mmengine's ``AmpOptimWrapper``: autocast in ``optim_context``, ``GradScaler`` loss scaling
    (``ShardedGradScaler`` with ``use_fsdp``); ``loss_scale`` ints are accepted too."""

    valid_dtypes = tuple(_DTYPES)

    def __init__(
        self,
        optimizer: Any,
        *,
        loss_scale: str | float | int | dict[str, Any] = "dynamic",
        dtype: str | torch.dtype | None = None,
        use_fsdp: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(optimizer, **kwargs)
        first = next((p for group in optimizer.param_groups for p in group["params"]), None)
        self.device: torch.device = first.device if first is not None else torch.device("cpu")
        if dtype is None:
            dtype = torch.float16 if self.device.type == "cuda" else torch.bfloat16
        elif isinstance(dtype, str):
            if dtype not in _DTYPES:
                raise ValueError(f"AmpOptimWrapper: dtype must be one of {self.valid_dtypes}, got {dtype!r}.")
            dtype = _DTYPES[dtype]
        elif not isinstance(dtype, torch.dtype) or dtype not in _DTYPES.values():
            raise TypeError(
                f"AmpOptimWrapper: dtype must be one of {self.valid_dtypes} or None, got {dtype!r}."
            )
        self.cast_dtype = dtype
        self._static_scale: float | None = None
        if loss_scale == "dynamic":
            scaler_kwargs: dict[str, Any] = {}
        elif isinstance(loss_scale, int | float) and not isinstance(loss_scale, bool):
            if loss_scale <= 0:
                raise ValueError(f"AmpOptimWrapper: loss_scale must be > 0, got {loss_scale!r}.")
            self._static_scale = float(loss_scale)
            scaler_kwargs = {"init_scale": float(loss_scale)}
        elif isinstance(loss_scale, Mapping):
            scaler_kwargs = dict(loss_scale)
        else:
            raise TypeError(
                f"AmpOptimWrapper: loss_scale must be 'dynamic', a number or a dict of GradScaler arguments, "
                f"got {loss_scale!r}."
            )
        enabled = dtype == torch.float16
        if use_fsdp:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            if not is_distributed():
                raise RuntimeError(
                    "AmpOptimWrapper: use_fsdp=True agrees on overflows across ranks and needs an initialised "
                    "process group; leave use_fsdp=False on one process."
                )

            self.loss_scaler: Any = ShardedGradScaler(self.device.type, enabled=enabled, **scaler_kwargs)
        else:
            self.loss_scaler = torch.amp.GradScaler(self.device.type, enabled=enabled, **scaler_kwargs)

    def run_backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss_scaler.scale(loss).backward(**kwargs)``."""
        self.loss_scaler.scale(loss).backward(**kwargs)

    def before_clip(self) -> None:
        """``loss_scaler.unscale_(optimizer)``: clip the true gradients."""
        self.loss_scaler.unscale_(self.optimizer)

    def optimizer_step(self, **kwargs: Any) -> Any:
        """``loss_scaler.step(optimizer)`` (skipped on overflow), then ``loss_scaler.update()``."""
        out = self.loss_scaler.step(self.optimizer, **kwargs)
        self.loss_scaler.update(self._static_scale)
        return out

    @contextmanager
    def optim_context(self, model: Any) -> Iterator[None]:
        """accum's no-sync logic plus ``torch.autocast(device, dtype)`` around the forward."""
        with super().optim_context(model), torch.autocast(self.device.type, dtype=self.cast_dtype):
            yield

    def state_dict(self) -> dict[str, Any]:
        """accum's state dict plus ``loss_scaler``."""
        state = super().state_dict()
        state["loss_scaler"] = self.loss_scaler.state_dict()
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        state = dict(state_dict)
        scaler = state.pop("loss_scaler", None)
        if scaler:
            self.loss_scaler.load_state_dict(scaler)
        super().load_state_dict(state)
