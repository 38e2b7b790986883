# SPDX-License-Identifier: Apache-2.0
"""``FusedSGD``: multi-tensor SGD with momentum (apex/ColossalAI signature, torch.optim.SGD semantics)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, MutableMapping
from typing import Any

from torch.optim.optimizer import required

from stepforge.core import (
    HyperParameterError,
    check_bool,
    check_dampening,
    check_lr,
    check_momentum,
    check_nesterov,
    check_weight_decay,
)

from ._backend import SGD
from ._base import FusedOptimizerBase
from ._step.eager import fused_step

__all__ = ["FusedSGD"]


class FusedSGD(FusedOptimizerBase):
    """SGD in one multi-tensor kernel per (device, dtype) bucket.

    Math per parameter (``torch.optim.SGD``; ``wd_after_momentum`` as in apex)::

        g = g / div_scale ;  g = g + wd*p            (unless wd_after_momentum)
        buf = g on the parameter's first step, else momentum*buf + (1-dampening)*g
        d = g + momentum*buf if nesterov else buf ;  d = d + wd*p   (if wd_after_momentum)
        p = p - lr*d

    The first-step buffer initialisation is tracked per parameter (apex uses one flag per launch).

    - ``momentum``, ``dampening``, ``weight_decay``, ``nesterov``, ``wd_after_momentum``: as above (nesterov needs momentum > 0,
      dampening 0).
    - ``master_weights``, ``skip_nonfinite``, ``assume_stable_grads``, ``capturable``: as in :class:`~stepforge.fused.FusedAdam`.

    Args:
        params: parameters or param-group dicts.
        lr: learning rate (required).

    State per parameter equals ``torch.optim.SGD``'s: ``momentum_buffer`` (float32), only with momentum.
    """

    _owner = "FusedSGD"
    _kernel = SGD
    _uses_steps = False
    _extra_state_keys = ("momentum_buffer",)  # torch.optim.SGD stores None there without momentum

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = required,  # type: ignore[assignment]
        momentum: float = 0,
        dampening: float = 0,
        weight_decay: float = 0,
        nesterov: bool = False,
        wd_after_momentum: bool = False,
        *,
        master_weights: bool = False,
        skip_nonfinite: bool | None = None,
        assume_stable_grads: bool = False,
        capturable: bool = False,
    ) -> None:
        if lr is required:  # type: ignore[comparison-overlap]  # torch.optim's sentinel, typed as its own class
            raise HyperParameterError("FusedSGD: lr is required (e.g. FusedSGD(params, lr=0.1)).")
        check_lr(lr, owner=self._owner)
        check_momentum(momentum, owner=self._owner)
        check_dampening(dampening, owner=self._owner)
        check_weight_decay(weight_decay, owner=self._owner)
        check_nesterov(nesterov, momentum, dampening, owner=self._owner)
        check_bool("wd_after_momentum", wd_after_momentum, owner=self._owner)
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            wd_after_momentum=wd_after_momentum,
        )
        super().__init__(
            params,
            defaults,
            master_weights=master_weights,
            skip_nonfinite=skip_nonfinite,
            assume_stable_grads=assume_stable_grads,
            capturable=capturable,
        )

    def _check_group(self, group: MutableMapping[str, Any]) -> None:
        super()._check_group(group)
        owner = self._owner
        check_momentum(group["momentum"], owner=owner)
        check_dampening(group["dampening"], owner=owner)
        check_weight_decay(group["weight_decay"], owner=owner)
        check_nesterov(group["nesterov"], group["momentum"], group["dampening"], owner=owner)
        check_bool("wd_after_momentum", group["wd_after_momentum"], owner=owner)

    def _state_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("momentum_buffer",) if group["momentum"] != 0 else ()

    def _torch_group_keys(self, group: dict[str, Any]) -> dict[str, Any]:
        return {"maximize": False, "foreach": None, "differentiable": False, "fused": None}

    def _init_state(self, p: Any, group: dict[str, Any], moved: bool = False) -> tuple[dict[str, Any], bool]:
        # torch.optim.SGD stores momentum_buffer=None when momentum is 0; treat None as "no buffer yet".
        state = self.state[p]
        if "momentum_buffer" in state and state["momentum_buffer"] is None:
            del state["momentum_buffer"]
        return super()._init_state(p, group, moved)

    def step(self, closure: Callable[[], Any] | None = None, div_scale: float = -1) -> Any:
        """One optimizer step; ``div_scale > 0`` divides every grad first."""
        return fused_step(self, closure, div_scale)
