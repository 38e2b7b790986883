# SPDX-License-Identifier: Apache-2.0
"""mmengine's message-hub state as plain containers and tensors, so a checkpoint loads under ``weights_only``.

``MessageHub.state_dict()`` holds ``HistoryBuffer`` objects (numpy arrays inside) that torch's default
``torch.load(weights_only=True)`` refuses. :func:`message_hub_to_plain` turns each buffer into a dict of two
tensors and its ``max_length`` and numpy values into tensors or Python scalars; :func:`message_hub_from_plain`
rebuilds what ``MessageHub.load_state_dict`` expects. Nothing is registered with
``torch.serialization.add_safe_globals``: the allow-list stays torch's own.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from mmengine.logging import HistoryBuffer

__all__ = ["PLAIN_FORMAT", "message_hub_to_plain", "message_hub_from_plain"]

#: marks a converted state; :func:`message_hub_from_plain` passes anything else through unchanged
PLAIN_FORMAT = "stepforge.mmengine.message_hub/1"
_PLAIN_SCALARS = (str, int, float, bool, type(None), torch.Tensor)


def _plain_value(key: str, value: Any) -> tuple[bool, Any, bool]:
    """(keep, converted value, was a numpy array)."""
    if isinstance(value, np.ndarray):
        return True, torch.from_numpy(np.ascontiguousarray(value).copy()), True
    if isinstance(value, np.generic):
        return True, value.item(), False
    if _is_plain(value):
        return True, value, False
    warnings.warn(
        f"stepforge.mmengine: message-hub runtime info {key!r} ({type(value).__name__}) is not plain data "
        "(str/int/float/bool/None/tensor, or lists/tuples/dicts of them) and is left out of the checkpoint so that "
        "it loads with torch.load(weights_only=True); store a plain value with message_hub.update_info",
        UserWarning,
        stacklevel=4,
    )
    return False, None, False


def _is_plain(value: Any) -> bool:
    if isinstance(value, _PLAIN_SCALARS):
        return True
    if isinstance(value, list | tuple):
        return all(_is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str | int) and _is_plain(v) for k, v in value.items())
    return False


def message_hub_to_plain(state: Mapping[str, Any]) -> dict[str, Any]:
    """Convert ``MessageHub.state_dict()`` to dicts, lists, Python scalars and tensors.

    Args:
        state: ``{"log_scalars": {name: HistoryBuffer}, "runtime_info": {name: value},
            "resumed_keys": {name: bool}}``.

    Returns:
        ``{"format": PLAIN_FORMAT, "log_scalars": {name: {"log_history": Tensor[n] (float64),
        "count_history": Tensor[n], "max_length": int}}, "runtime_info": {...}, "ndarray_keys": [...],
        "resumed_keys": {...}}``; runtime values that are not plain data are dropped with a warning.
    """
    if not isinstance(state, Mapping) or "log_scalars" not in state or "runtime_info" not in state:
        raise TypeError(
            "message_hub_to_plain: expected MessageHub.state_dict() (a dict with 'log_scalars' and "
            f"'runtime_info'), got {type(state).__name__}"
        )
    scalars: dict[str, Any] = {}
    for name, buffer in state["log_scalars"].items():
        if not isinstance(buffer, HistoryBuffer):
            raise TypeError(
                f"message_hub_to_plain: log_scalars[{name!r}] is a {type(buffer).__name__}, not a HistoryBuffer"
            )
        log_history, count_history = buffer.data
        scalars[str(name)] = {
            "log_history": torch.from_numpy(np.ascontiguousarray(log_history).copy()),
            "count_history": torch.from_numpy(np.ascontiguousarray(count_history).copy()),
            "max_length": int(buffer.max_length),
        }
    info: dict[str, Any] = {}
    arrays: list[str] = []
    for name, value in state["runtime_info"].items():
        keep, plain, was_array = _plain_value(str(name), value)
        if keep:
            info[str(name)] = plain
            if was_array:
                arrays.append(str(name))
    resumed = {str(k): bool(v) for k, v in dict(state.get("resumed_keys", {})).items()}
    return {
        "format": PLAIN_FORMAT,
        "log_scalars": scalars,
        "runtime_info": info,
        "ndarray_keys": arrays,
        "resumed_keys": resumed,
    }


def message_hub_from_plain(state: Any) -> Any:
    """Inverse of :func:`message_hub_to_plain` (``HistoryBuffer`` and numpy arrays back); other input unchanged.

    The tensors may arrive on a GPU (``resume`` reads with ``map_location`` = the plugin's device): they are
    copied to the CPU before becoming numpy arrays."""
    if not (isinstance(state, Mapping) and state.get("format") == PLAIN_FORMAT):
        return state
    scalars = {
        name: HistoryBuffer(
            entry["log_history"].cpu().numpy(), entry["count_history"].cpu().numpy(), int(entry["max_length"])
        )
        for name, entry in state["log_scalars"].items()
    }
    info = dict(state["runtime_info"])
    for name in state.get("ndarray_keys", []):
        if name in info:
            info[name] = info[name].cpu().numpy()
    return {"log_scalars": scalars, "runtime_info": info, "resumed_keys": dict(state["resumed_keys"])}
