# SPDX-License-Identifier: Apache-2.0
"""torch.compile's module wrapper: ``torch.compile(module)`` returns a ``torch._dynamo.eval_frame.OptimizedModule``
whose ``state_dict`` keys carry an ``_orig_mod.`` prefix. torch exports no public name for the class; the Booster
recognises it to refuse ``compile=`` on a model that is already compiled (it would be compiled twice)."""

from __future__ import annotations

from typing import Any

__all__ = ["compiled_module_type", "is_compiled_module"]


def compiled_module_type() -> type | None:
    """``OptimizedModule`` (what ``torch.compile(module)`` returns), or ``None`` on a torch without dynamo."""
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:  # pragma: no cover - a torch built without dynamo
        return None
    return OptimizedModule


def is_compiled_module(model: Any) -> bool:
    """Whether ``model`` is the wrapper ``torch.compile(module)`` returns (not a module compiled in place by
    ``module.compile()``, whose keys are unchanged)."""
    wrapper = compiled_module_type()
    return wrapper is not None and isinstance(model, wrapper)
