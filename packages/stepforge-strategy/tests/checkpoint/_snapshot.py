# SPDX-License-Identifier: Apache-2.0
"""A bitwise snapshot of everything a Strategy load may touch, for the verify-then-apply tests."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from stepforge.core import unwrap_optimizer
from stepforge.strategy import Strategy
from stepforge.strategy.checkpoint._fsdp_window import fsdp_pending_grads


class Position:
    """A data position registered for checkpointing (as a sampler's state)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def state_dict(self) -> dict[str, int]:
        return {"at": self.at}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.at = int(state["at"])


def _plain(value: Any) -> Any:
    """Tensors (DTensors as their local shard) cloned; containers copied; the rest as is."""
    if isinstance(value, DTensor):
        value = value.to_local()
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, tuple(value.shape), value.detach().cpu().clone())
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, np.ndarray):
        return ("ndarray", value.copy())
    return value


def snapshot(s: Strategy) -> dict[str, Any]:
    """Model parameters and buffers, ``.grad``s, FSDP2 pending gradients, the torch optimizer's state and
    param_groups (lr included), the boosted optimizer's scaler, schedulers, accumulation window and settings,
    registered statefuls, ``cur_iter`` and the torch/numpy/python RNG states."""
    model, wrapper, schedulers = s._components()
    inner = unwrap_optimizer(wrapper.optimizer)
    params = list(model.parameters())
    index = {p: i for i, p in enumerate(params)}
    return _plain(
        dict(
            # the class's state_dict: this rank's shards under FSDP2 (whose instance state_dict() gathers)
            model={k: v for k, v in type(model).state_dict(model).items()},
            params=params,
            grads=[p.grad for p in params],
            pending=fsdp_pending_grads(model),
            state={index.get(p, -1): dict(v) for p, v in inner.state.items()},
            groups=[{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups],
            group_sizes=[len(g["params"]) for g in inner.param_groups],
            scaler=wrapper.optimizer.scaler_state_dict(),
            schedulers=[sch.state_dict() for sch in schedulers],
            window=wrapper.window.state_dict(),
            base=wrapper.base_param_settings,
            statefuls={name: obj.state_dict() for name, (obj, _) in s.statefuls.items()},
            cur_iter=s.dispatch_kwargs.get("cur_iter"),
            rng_torch=torch.get_rng_state(),
            rng_numpy=np.random.get_state(),
            rng_python=random.getstate(),
        )
    )


def differences(a: Any, b: Any, where: str = "") -> list[str]:
    """Where two snapshots differ (bitwise for tensors: dtype, shape and every byte)."""
    if isinstance(a, tuple) and a[:1] == ("tensor",) and isinstance(b, tuple) and b[:1] == ("tensor",):
        same = (
            a[1] == b[1]
            and a[2] == b[2]
            and torch.equal(a[3].reshape(-1).view(torch.uint8), b[3].reshape(-1).view(torch.uint8))
        )
        return [] if same else [where]
    if isinstance(a, tuple) and a[:1] == ("ndarray",) and isinstance(b, tuple) and b[:1] == ("ndarray",):
        return [] if np.array_equal(a[1], b[1]) else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where} keys {sorted(map(str, a))} != {sorted(map(str, b))}"]
        return [d for k in a for d in differences(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        if len(a) != len(b) or type(a) is not type(b):
            return [f"{where} length {len(a)} != {len(b)}"]
        return [
            d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in differences(x, y, f"{where}[{i}]")
        ]
    if isinstance(a, float) and isinstance(b, float):
        return [] if np.float64(a).tobytes() == np.float64(b).tobytes() else [where]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]
