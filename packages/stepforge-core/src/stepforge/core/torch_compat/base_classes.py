# SPDX-License-Identifier: Apache-2.0
"""torch's private classes: ``nn.modules.batchnorm._NormBase`` (layers with running statistics),
``torch.optim.lr_scheduler._LRScheduler`` (the scheduler base ColossalAI's code checks with ``isinstance``) and
``torch._dynamo.eval_frame.OptimizedModule``, what ``torch.compile(module)`` returns (its ``state_dict`` keys carry
an ``_orig_mod.`` prefix; the Booster recognises it to refuse ``compile=`` on a model already compiled)."""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["LegacyLRScheduler", "compiled_module_type", "is_compiled_module", "is_norm_with_running_stats"]


def is_norm_with_running_stats(module: Any) -> bool:
    """Whether ``module`` is a BatchNorm, SyncBatchNorm or InstanceNorm layer (lazy ones included): a layer
    whose forward may update running statistics."""
    return isinstance(module, nn.modules.batchnorm._NormBase)


#: ``torch.optim.lr_scheduler._LRScheduler`` (a subclass of the public ``LRScheduler``), or ``LRScheduler`` on a
#: torch without the old name. Subclass it to pass ``isinstance(x, _LRScheduler)`` checks of ColossalAI code.
try:
    from torch.optim.lr_scheduler import _LRScheduler as LegacyLRScheduler
except ImportError:  # pragma: no cover - a torch that dropped the old name: LRScheduler is what remains
    from torch.optim.lr_scheduler import LRScheduler as LegacyLRScheduler  # type: ignore[assignment]


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
