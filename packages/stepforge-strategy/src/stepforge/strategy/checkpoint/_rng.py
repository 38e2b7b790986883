# SPDX-License-Identifier: Apache-2.0
"""Capture and restore this process's random number generators (python, numpy, torch CPU, every CUDA device)."""

from __future__ import annotations

import random
from typing import Any

import torch

__all__ = ["get_rng_state", "set_rng_state"]


def get_rng_state() -> dict[str, Any]:
    """The state of every generator this process uses, as values ``torch.load(weights_only=True)`` reads."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        # as plain values and a tensor, so the checkpoint loads under torch.load(weights_only=True)
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = (
            kind,
            torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            int(pos),
            int(has_gauss),
            float(cached),
        )
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore :func:`get_rng_state`'s output (generators absent from it, or from this process, are left alone)."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"].cpu())
    if "numpy" in state:
        try:
            import numpy as np
        except ImportError:
            pass
        else:
            kind, keys, pos, has_gauss, cached = state["numpy"]
            if isinstance(keys, torch.Tensor):
                # resume's default map_location is the plugin's device: on a GPU the keys arrive on cuda
                keys = keys.cpu().numpy().astype(np.uint32)
            np.random.set_state((kind, keys, pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        saved = state["cuda"]
        if len(saved) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([s.cpu() for s in saved])
