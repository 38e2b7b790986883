# SPDX-License-Identifier: Apache-2.0
"""Capture and restore this process's random number generators (python, numpy, torch CPU, every CUDA device).

The state is tensors, ints, floats and strings only, so it loads under ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import random
from typing import Any

import torch

__all__ = ["get_rng_state", "set_rng_state"]


def _python_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    return {"version": version, "internal": torch.tensor(internal, dtype=torch.int64), "gauss": gauss}


def _set_python_state(state: dict[str, Any]) -> None:
    internal = tuple(int(v) for v in state["internal"].tolist())
    random.setstate((int(state["version"]), internal, state["gauss"]))


def get_rng_state() -> dict[str, Any]:
    """The state of every generator this process uses, as tensors and plain values."""
    state: dict[str, Any] = {"python": _python_state(), "torch": torch.get_rng_state()}
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {
            "name": str(name),
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore :func:`get_rng_state`'s output (generators absent from it, or from this process, are left alone)."""
    _set_python_state(state["python"])
    torch.set_rng_state(state["torch"].cpu())
    if "numpy" in state:
        try:
            import numpy as np
        except ImportError:
            pass
        else:
            saved = state["numpy"]
            keys = saved["keys"].cpu().numpy().astype(np.uint32)
            np.random.set_state(
                (saved["name"], keys, saved["pos"], saved["has_gauss"], saved["cached_gaussian"])
            )
    if "cuda" in state and torch.cuda.is_available():
        saved = state["cuda"]
        if len(saved) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([s.cpu() for s in saved])
