# SPDX-License-Identifier: Apache-2.0
"""The state-dict members of ``LowLevelZeroOptimizer`` (full, sharded, the loss scaler's part, ``unwrap``): a
mixin over the layout, the inner optimizer, the reducer and the scaler the optimizer builds. The tensor work is
in :mod:`._full_state` and :mod:`._sharded_state`, which take the layout, never the optimizer."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from stepforge.core.precision import DynamicLossScaler

from . import _full_state, _sharded_state
from ._buckets import GradReducer
from ._full_state import zero_scaler_entry
from ._partition import ShardLayout

__all__ = ["StateDictMembers"]


class StateDictMembers:
    """``state_dict``/``load_state_dict``, ``sharded_state_dict``/``load_sharded_state_dict``, the scaler's
    state and ``unwrap`` of a ZeRO optimizer (see the module docstring)."""

    _layout: ShardLayout
    _reducer: GradReducer
    optim: torch.optim.Optimizer
    param_groups: list[dict[str, Any]]
    scaler: DynamicLossScaler
    skipped_steps: int
    wait_for_param_gather: Callable[[], None]

    def _zero_extras(self) -> dict[str, Any]:
        return {
            "loss_scaler": zero_scaler_entry(self.scaler.state_dict()),
            "skipped_steps": self.skipped_steps,
        }

    def scaler_state_dict(self) -> dict[str, Any] | None:
        """``None``: the loss scaler's state is part of this optimizer's own state (:meth:`state_dict` and
        :meth:`sharded_state_dict`, under ``["zero"]["loss_scaler"]``), so nothing has to travel beside it --
        and checkpoints keep the layout they had before ``stepforge.core.precision``. Read ``scaler.state_dict()``
        for the scaler alone."""
        return None

    def load_scaler_state_dict(self, state: Mapping[str, Any] | None) -> None:
        """Load a loss-scaler state written apart (``DynamicLossScaler``'s or ``torch.amp.GradScaler``'s, or
        zero's own ``["zero"]["loss_scaler"]`` entry); ``None`` or ``{}`` change nothing."""
        if state:
            self.scaler.load_state_dict(state)

    def unwrap(self) -> torch.optim.Optimizer:
        """The inner optimizer, which steps this rank's master pieces (ColossalAI's ``OptimizerWrapper.unwrap``)."""
        return self.optim

    def state_dict(self) -> dict[str, Any]:
        """The full state in ``torch.optim`` layout keyed by global parameter index (collective: every rank
        must call it; every rank gets the full state). Extra key ``"zero"``: loss scaler, skip counter and
        the fp32 masters of low-precision parameters."""
        self.wait_for_param_gather()
        return _full_state.full_state_dict(self._layout, self.optim, self.param_groups, self._zero_extras())

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a full state (from :meth:`state_dict` at any world size, or a plain ``torch.optim`` one)."""
        self._reducer.wait()
        self.wait_for_param_gather()
        zero = _full_state.load_full_state_dict(self._layout, self.optim, self.param_groups, state_dict)
        if "loss_scaler" in zero:
            self.scaler.load_state_dict(zero["loss_scaler"])
        self.skipped_steps = int(zero.get("skipped_steps", self.skipped_steps))

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's pieces as 1-D ``DTensor`` (``Shard(0)``) for ``torch.distributed.checkpoint``; no
        gathering. For a never-stepped optimizer the state entries are laid out for the result without stepping
        it (a throwaway optimizer of the same class steps zero copies of the masters), so the result is a
        template for ``dcp.load`` and the optimizer, its parameters and gradients are untouched."""
        self._reducer.wait()
        self.wait_for_param_gather()
        return _sharded_state.sharded_state_dict(
            self._layout, self.optim, self.param_groups, self._zero_extras()
        )

    def load_sharded_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load :meth:`sharded_state_dict`'s form after ``torch.distributed.checkpoint.load`` filled it."""
        self._reducer.wait()
        self.wait_for_param_gather()
        zero = _sharded_state.load_sharded_state_dict(self._layout, self.optim, self.param_groups, state_dict)
        self.scaler.load_state_dict(zero["loss_scaler"])
        self.skipped_steps = int(zero.get("skipped_steps", 0))
