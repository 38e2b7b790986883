# SPDX-License-Identifier: Apache-2.0
"""The model an estimate is made for: an ``nn.Module``, a factory called on the meta device, or a Hugging Face
``transformers`` config (built on the meta device with ``AutoModelForCausalLM.from_config``)."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["resolve_model", "parameter_count", "load_transformers_config"]


def _transformers() -> Any:
    """The ``transformers`` module, or ``None`` when it is not installed (an optional dependency)."""
    if importlib.util.find_spec("transformers") is None:
        return None
    return importlib.import_module("transformers")


def _transformers_config(model: Any) -> bool:
    transformers = _transformers()
    return transformers is not None and isinstance(model, transformers.PretrainedConfig)


def resolve_model(model: nn.Module | Callable[[], nn.Module] | Any) -> nn.Module:
    """``model`` as an ``nn.Module`` (a factory or a transformers config is built on the meta device: no memory).

    Raises:
        TypeError: anything else, or a factory that does not return a module.
    """
    if isinstance(model, nn.Module):
        return model
    if _transformers_config(model):
        with torch.device("meta"):
            built: nn.Module = _transformers().AutoModelForCausalLM.from_config(model)
        return built
    if callable(model):
        with torch.device("meta"):
            built = model()
        if not isinstance(built, nn.Module):
            raise TypeError(
                f"estimate: the model factory returned {type(built).__name__}, not a torch.nn.Module; pass a "
                "function that builds the model (it is called under torch.device('meta'))."
            )
        return built
    raise TypeError(
        "estimate: model must be a torch.nn.Module, a function building one (called on the meta device) or a "
        f"transformers config; got {type(model).__name__}."
    )


def parameter_count(model: nn.Module) -> int:
    """Elements of ``model``'s parameters, tied ones counted once."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def load_transformers_config(name: str) -> Any:
    """The transformers config of ``name``: a local folder holding ``config.json``, or a hub name already in the
    local Hugging Face cache (``local_files_only``: the network is never used).

    Raises:
        ImportError: transformers is not installed (``pip install transformers``).
        ValueError: ``name`` is neither a local folder nor in the local cache; the message says how to get it.
    """
    transformers = _transformers()
    if transformers is None:
        raise ImportError("hf: models need transformers (pip install transformers)")
    try:
        return transformers.AutoConfig.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError) as exc:  # not cached, not a folder, or not a valid hub name
        raise ValueError(
            f"hf:{name} is neither a local folder nor in the local Hugging Face cache (download it first: "
            f"huggingface-cli download {name} config.json; or give a folder holding config.json)"
        ) from exc
