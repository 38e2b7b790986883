# SPDX-License-Identifier: Apache-2.0
"""Checks of the options a :class:`~stepforge.strategy.Strategy` takes, each raising where the option enters
with a message that names it and what it accepts."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["check_auto_scale_lr", "check_dict", "check_global_batch_size", "check_model_wrapper"]

_AUTO_SCALE_LR_KEYS = frozenset({"base_batch_size", "enable"})


def check_dict(name: str, value: Any, allowed: frozenset[str] | None = None) -> dict[str, Any]:
    """``value`` (a mapping or ``None``) as a new dict; ``allowed`` limits its keys. ``name`` is the option."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(f"{name} must be a dict, got {type(value).__name__}")
    if allowed is not None and set(value) - allowed:
        raise ValueError(f"{name}: unknown key(s) {sorted(set(value) - allowed)}; allowed: {sorted(allowed)}")
    return dict(value)


def check_auto_scale_lr(auto_scale_lr: Mapping[str, Any] | None) -> dict[str, Any]:
    """``auto_scale_lr`` as a dict (``{}``: no scaling); when enabled, ``base_batch_size`` is a positive int."""
    checked = check_dict("auto_scale_lr", auto_scale_lr, _AUTO_SCALE_LR_KEYS)
    if checked.get("enable", True) and checked:
        base = checked.get("base_batch_size")
        if not isinstance(base, int) or base <= 0:
            raise ValueError(f"auto_scale_lr needs base_batch_size, a positive int; got {base!r}")
    return checked


def check_model_wrapper(model_wrapper: Any) -> None:
    """``model_wrapper`` is ``None`` or a callable taking the boosted model."""
    if model_wrapper is not None and not callable(model_wrapper):
        raise TypeError(
            f"model_wrapper must be None or a callable taking the boosted model, got {model_wrapper!r}"
        )


def check_global_batch_size(value: Any) -> int | None:
    """``global_batch_size`` is ``None`` or a positive int (samples per optimizer step over every rank)."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
        raise ValueError(
            "global_batch_size must be None or a positive int (samples per optimizer step over all ranks: world "
            f"size x train_micro_batch_size_per_gpu x accumulative_counts), got {value!r}"
        )
    return value
