# SPDX-License-Identifier: Apache-2.0
"""``OptimizerWrapper`` (alias ``BoostedOptimizer``): what the strategy's plugins return for an optimizer.

ColossalAI's ``OptimizerWrapper``; it implements :class:`stepforge.core.BoostedOptimizer`. The torch optimizer
surface (``param_groups``, ``state``, ``step``, ``zero_grad``, ``state_dict``...) plus ``backward(loss)``,
``backward_by_grad``, ``unscale_``, ``clip_grad_norm_``, ``unwrap()`` and, for fp16, a :class:`DynamicLossScaler`
whose state travels in ``state_dict()["grad_scaler"]`` (and through ``scaler_state_dict``). ``max_norm`` > 0
clips by the global norm inside ``step``. The scaler's process group makes its overflow check agree across the
ranks of a sharded (FSDP2) optimizer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from stepforge.core import BoostedOptimizer as BoostedOptimizerProtocol
from stepforge.core.precision import DynamicLossScaler

__all__ = ["OptimizerWrapper", "BoostedOptimizer", "as_boosted"]


class OptimizerWrapper(torch.optim.Optimizer):
    """Wrap ``optimizer`` for the Booster (implements :class:`stepforge.core.BoostedOptimizer`).

    A ``torch.optim.Optimizer`` subclass (so ``torch.optim.lr_scheduler`` accepts it) that delegates
    ``param_groups``, ``state`` and ``defaults`` to the wrapped optimizer; ``Optimizer.__init__`` is not run.

    Args:
        optimizer: the torch optimizer (over the plugin's parameters: DDP's, FSDP2's DTensors...).
        scaler: a :class:`DynamicLossScaler` for fp16 loss scaling, or ``None``.
        max_norm: clip gradients to this global norm inside :meth:`step` (0: no clipping).
        norm_type: the norm used for clipping.
        clip_fn: ``clip_fn(max_norm, norm_type) -> norm``, the plugin's global-norm clipping.
    """

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
        self.optim.zero_grad(set_to_none=set_to_none)

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without fp16 scaling)."""
        return float(self.scaler.get_scale()) if self.scaler is not None else 1.0

    # -- backward ------------------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """``loss.backward()``, scaled by the fp16 loss scale when there is one."""
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward(*args, **kwargs)

    def backward_by_grad(self, tensor: torch.Tensor, grad: torch.Tensor) -> None:
        """``torch.autograd.backward(tensor, grad)``, with ``grad`` scaled like the loss."""
        if self.scaler is not None:
            grad = self.scaler.scale(grad)
        torch.autograd.backward(tensor, grad)

    def unscale_(self) -> None:
        """Divide the gradients by the loss scale (once per step; a no-op without fp16)."""
        if self.scaler is None or self._unscaled:
            return
        self.scaler.unscale_(self.optim)
        self._unscaled = True

    def unscale_grad(self) -> None:  # ColossalAI's name
        """:meth:`unscale_`."""
        self.unscale_()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the global norm (over every shard) of the unscaled gradients; return that norm."""
        self.unscale_()
        if self._clip_fn is not None:
            norm = self._clip_fn(max_norm, norm_type)
        else:
            params = [p for g in self.optim.param_groups for p in g["params"] if p.grad is not None]
            norm = nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
            if isinstance(norm, DTensor):
                norm = norm.full_tensor()
        self.grad_norm = norm
        return norm

    def clip_grad_by_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:  # ColossalAI
        return self.clip_grad_norm_(max_norm, norm_type)

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

    def __repr__(self) -> str:
        return f"OptimizerWrapper({self.optim!r}, scaler={self.scaler is not None}, max_norm={self.max_norm})"


#: the name stepforge-strategy used before it took ColossalAI's
BoostedOptimizer = OptimizerWrapper


def as_boosted(optimizer: Any, *, max_norm: float = 0.0) -> Any:
    """``optimizer`` as a :class:`stepforge.core.BoostedOptimizer`: ``None`` and boosted optimizers as they are
    (the Booster's mixed precision may have wrapped it already), a torch optimizer in an
    :class:`OptimizerWrapper`."""
    if optimizer is None or isinstance(optimizer, BoostedOptimizerProtocol):
        return optimizer
    return OptimizerWrapper(optimizer, max_norm=max_norm)
