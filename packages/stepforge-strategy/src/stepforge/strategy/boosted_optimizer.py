# SPDX-License-Identifier: Apache-2.0
"""``OptimizerWrapper``: ColossalAI's boosted optimizer, what the strategy's plugins return (a
:class:`stepforge.core.BoostedOptimizer`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from stepforge.core import BoostedOptimizer as BoostedOptimizerProtocol
from stepforge.core.precision import DynamicLossScaler

__all__ = ["OptimizerWrapper", "as_boosted"]


class OptimizerWrapper(torch.optim.Optimizer):
    """Wrap ``optimizer`` for the Booster: a ``torch.optim.Optimizer`` (so ``lr_scheduler`` accepts it)
    delegating to it; ``scaler``: fp16 loss scaling (saved as ``state_dict()["grad_scaler"]``); ``max_norm`` >
    0 clips inside :meth:`step`, through ``clip_fn`` when given."""

    def __init__(
        self,
        optimizer: Any,
        *,
        scaler: DynamicLossScaler | None = None,
        max_norm: float = 0.0,
        norm_type: float = 2.0,
        clip_fn: Callable[[float, float], torch.Tensor] | None = None,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}.")
        if isinstance(optimizer, BoostedOptimizerProtocol):
            raise TypeError(
                f"optimizer is already boosted ({type(optimizer).__name__}); wrap the torch optimizer under it "
                "(optimizer.unwrap())."
            )
        if max_norm < 0:
            raise ValueError(f"max_norm must be >= 0 (0 turns clipping off), got {max_norm!r}.")
        self.optim = optimizer
        self.scaler = scaler
        self.max_norm = float(max_norm)
        self.norm_type = float(norm_type)
        self._clip_fn = clip_fn
        self._unscaled = False
        self.last_step_skipped = False
        self.skipped_steps = 0
        self.grad_norm: torch.Tensor | None = None
        self._norm_fresh = False  # grad_norm belongs to the gradients there now
        self._stepped_unscaled = False  # step() unscaled the gradients still there
        self._model: nn.Module | None = None

    # -- torch.optim surface -------------------------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optim.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optim.param_groups = value

    @property
    def state(self) -> Any:
        return self.optim.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optim.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optim.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optim.defaults = value

    def add_param_group(self, group: dict[str, Any]) -> None:
        self.optim.add_param_group(group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._norm_fresh = self._stepped_unscaled = False
        self.optim.zero_grad(set_to_none=set_to_none)

    @property
    def parameters(self) -> list[torch.Tensor]:
        """Every parameter of every group, in order (ColossalAI's property)."""
        return [p for group in self.optim.param_groups for p in group["params"]]

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without fp16 scaling)."""
        return float(self.scaler.get_scale()) if self.scaler is not None else 1.0

    # -- backward ------------------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """``loss.backward()``, scaled by the fp16 loss scale when there is one."""
        self._norm_fresh = self._stepped_unscaled = False
        loss = self.scale_loss(loss)
        loss.backward(*args, **kwargs)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the fp16 loss scale (``loss`` itself without scaling)."""
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def backward_by_grad(self, tensor: torch.Tensor, grad: torch.Tensor) -> None:
        """``torch.autograd.backward(tensor, grad)``, with ``grad`` scaled like the loss."""
        self._norm_fresh = self._stepped_unscaled = False
        if self.scaler is not None:
            grad = self.scaler.scale(grad)
        torch.autograd.backward(tensor, grad)

    def unscale_(self) -> None:
        """Divide the gradients by the loss scale (once per step; a no-op without fp16)."""
        if self.scaler is None or self._unscaled:
            return
        self.scaler.unscale_(self.optim)
        self._unscaled = True

    unscale_grad = unscale_  # ColossalAI's name

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the global norm (over every shard) of the unscaled gradients; return that norm."""
        self.unscale_()
        if self._clip_fn is not None:
            norm = self._clip_fn(max_norm, norm_type)
        else:
            norm = nn.utils.clip_grad_norm_(
                [p for p in self.parameters if p.grad is not None], max_norm, norm_type
            )
            norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        self.grad_norm = norm
        self._norm_fresh = True
        return norm

    def clip_grad_by_norm(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        """ColossalAI's name for :meth:`clip_grad_norm_`; ``error_if_nonfinite`` raises ``RuntimeError`` on an inf/nan
        norm, the gradients left unclipped."""
        if error_if_nonfinite:
            norm = self.get_grad_norm(norm_type)
            if norm is not None and not torch.isfinite(torch.tensor(norm)):
                raise RuntimeError(
                    f"clip_grad_by_norm: the total norm of order {norm_type} of the gradients is {norm}; pass "
                    "error_if_nonfinite=False to clip anyway."
                )
        return self.clip_grad_norm_(max_norm, norm_type)

    def clip_grad_by_value(self, clip_value: float, *args: Any, **kwargs: Any) -> None:
        """Unscale, then clamp every gradient element to ``[-clip_value, clip_value]``
        (``torch.nn.utils.clip_grad_value_``; extra arguments go to it)."""
        self.unscale_()
        nn.utils.clip_grad_value_(
            [p for p in self.parameters if p.grad is not None], clip_value, *args, **kwargs
        )
        self._norm_fresh = False

    def get_grad_norm(self, norm_type: float = 2.0, **kwargs: Any) -> float | None:
        """The global norm of the unscaled gradients there now: the one clipping measured, else measured here
        (collective for sharded models); ``None`` when no parameter has a gradient."""
        grads = [p.grad for p in self.parameters if p.grad is not None]
        if not grads:
            return None
        if self._norm_fresh and self.grad_norm is not None:
            return float(self.grad_norm)
        # DTensor gradients (FSDP2) give a norm reduced over the mesh; DDP's are equal on every rank
        norm = nn.utils.get_total_norm(grads, norm_type)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        if self.scaler is not None and not (self._unscaled or self._stepped_unscaled):
            norm = norm / self.scaler.get_scale()
        return float(norm)

    # -- step ----------------------------------------------------------------------------------------------
    def step(self, *args: Any, **kwargs: Any) -> Any:
        """Clip (``max_norm``), then step; with fp16 a step whose gradients overflowed is skipped and the
        loss scale backs off."""
        if self.max_norm > 0:
            self.clip_grad_norm_(self.max_norm, self.norm_type)
        if self.scaler is None:
            self.last_step_skipped = False
            return self.optim.step(*args, **kwargs)
        self.unscale_()
        self.last_step_skipped = self.scaler.found_inf
        out = None if self.last_step_skipped else self.optim.step(*args, **kwargs)
        self.scaler.update()
        self._unscaled = False
        self._stepped_unscaled = True
        self.skipped_steps += int(self.last_step_skipped)
        return out

    # -- checkpoint ----------------------------------------------------------------------------------------
    def scaler_state_dict(self) -> dict[str, Any] | None:
        """The loss scaler's state (``None`` without fp16 scaling)."""
        return self.scaler.state_dict() if self.scaler is not None else None

    def load_scaler_state_dict(self, state: Mapping[str, Any] | None) -> None:
        """Restore :meth:`scaler_state_dict`'s value (ignored without a scaler or without a saved state)."""
        if self.scaler is not None and state:
            self.scaler.load_state_dict(dict(state))

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state dict, plus ``grad_scaler`` with fp16."""
        state = self.optim.state_dict()
        if self.scaler is not None:
            state["grad_scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        state = dict(state_dict)
        scaler = state.pop("grad_scaler", None)
        self.optim.load_state_dict(state)
        self.load_scaler_state_dict(scaler)

    def unwrap(self) -> Any:
        """The wrapped torch optimizer."""
        return self.optim

    def bind_model(self, model: nn.Module) -> None:
        """Remember the boosted model (``Booster.boost`` does it) for :meth:`unwrap_model`."""
        self._model = model

    def unwrap_model(self) -> nn.Module:
        """The boosted model this optimizer was boosted with (ColossalAI's FSDP optimizer member); ``RuntimeError``
        when none is bound."""
        if self._model is None:
            raise RuntimeError(
                "OptimizerWrapper.unwrap_model: no model is bound; use the optimizer Booster.boost(model, optimizer) "
                "returned (or call bind_model(model))."
            )
        return self._model

    def __repr__(self) -> str:
        return f"OptimizerWrapper({self.optim!r}, scaler={self.scaler is not None}, max_norm={self.max_norm})"


def as_boosted(optimizer: Any, *, max_norm: float = 0.0) -> Any:
    """``optimizer`` as a :class:`stepforge.core.BoostedOptimizer`: ``None`` and boosted ones as they are, a
    torch optimizer in an :class:`OptimizerWrapper`."""
    if optimizer is None or isinstance(optimizer, BoostedOptimizerProtocol):
        return optimizer
    return OptimizerWrapper(optimizer, max_norm=max_norm)
