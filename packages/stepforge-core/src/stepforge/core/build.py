# SPDX-License-Identifier: Apache-2.0
"""``build_optimizer``: an optimizer from a config, whichever stepforge package provides it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from .errors import HyperParameterError
from .registry import OPTIMIZERS
from .validation import validate_hyperparameters

__all__ = ["build_optimizer", "collect_params"]

ParamsLike = torch.nn.Module | Iterable[torch.Tensor] | Iterable[dict[str, Any]]


def collect_params(params: ParamsLike, *, owner: str = "build_optimizer") -> list[Any]:
    """Turn a module, an iterable of tensors or an iterable of param-group dicts into a list.

    Raises:
        HyperParameterError: empty, a bare tensor, or items that are neither tensors nor dicts.
    """
    if isinstance(params, torch.nn.Module):
        items: list[Any] = list(params.parameters())
    elif isinstance(params, torch.Tensor):
        raise HyperParameterError(
            f"{owner}: params must be an iterable of tensors, param-group dicts or a module, got one tensor; "
            "wrap it in a list: [tensor]."
        )
    elif isinstance(params, Iterable) and not isinstance(params, str | bytes | Mapping):
        items = list(params)
    else:
        raise HyperParameterError(
            f"{owner}: params must be an iterable of tensors, param-group dicts or a torch.nn.Module, got "
            f"{type(params).__name__}."
        )
    if not items:
        raise HyperParameterError(f"{owner}: got an empty parameter list; pass model.parameters() or groups.")
    bad = next((p for p in items if not isinstance(p, torch.Tensor | Mapping)), None)
    dicts = sum(isinstance(p, Mapping) for p in items)
    if bad is not None or 0 < dicts < len(items):
        what = f"an item of type {type(bad).__name__}" if bad is not None else "both tensors and dicts"
        raise HyperParameterError(
            f"{owner}: params holds {what}; pass only tensors or only param-group dicts "
            "({'params': [...], 'lr': ...})."
        )
    if dicts:
        for i, group in enumerate(items):
            if "params" not in group:
                raise HyperParameterError(f"{owner}: param group {i} has no 'params' key.")
            validate_hyperparameters(group, owner=f"{owner} (param group {i})")
        return [dict(g) for g in items]
    return items


def build_optimizer(
    cfg: Mapping[str, Any] | torch.optim.Optimizer,
    params: ParamsLike | None = None,
) -> torch.optim.Optimizer:
    """Build an optimizer from ``cfg``, ``{"type": name_or_class, **kwargs}``, over ``params`` (a module, tensors
    or param-group dicts); an optimizer instance is returned unchanged (``params`` must then be ``None``).

    ``name`` is a registry name (``"FusedAdam"``, ``"lamb"``; case, ``-`` and ``_`` ignored) or a ``torch.optim``
    class name (``"AdamW"``). An unknown one raises :class:`UnknownNameError` naming the distribution to install;
    a bad hyper-parameter or ``params``, :class:`HyperParameterError`.
    """
    if isinstance(cfg, torch.optim.Optimizer):
        if params is not None:
            raise HyperParameterError(
                "build_optimizer: got an already-built optimizer and params; pass params=None (the optimizer "
                "already owns its parameters)."
            )
        return cfg
    if not isinstance(cfg, Mapping):
        raise HyperParameterError(
            f"build_optimizer: cfg must be a dict with a 'type' key or an optimizer, got {type(cfg).__name__}."
        )
    if "type" not in cfg:
        raise HyperParameterError(
            "build_optimizer: cfg has no 'type' key; e.g. dict(type='AdamW', lr=1e-3). Available: "
            + ", ".join(OPTIMIZERS.names())
        )
    if params is None:
        raise HyperParameterError("build_optimizer: params is required when cfg is a config dict.")
    kwargs = dict(cfg)
    kind = kwargs.pop("type")
    if isinstance(kind, str):
        cls = OPTIMIZERS.get(kind)
        owner = kind
    elif callable(kind):
        cls = kind
        owner = getattr(kind, "__name__", repr(kind))
    else:
        raise HyperParameterError(
            f"build_optimizer: 'type' must be a name or an optimizer class, got {type(kind).__name__}."
        )
    validate_hyperparameters(kwargs, owner=owner)
    optimizer: torch.optim.Optimizer = cls(collect_params(params, owner=owner), **kwargs)
    return optimizer
