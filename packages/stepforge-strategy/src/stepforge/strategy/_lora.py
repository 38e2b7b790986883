# SPDX-License-Identifier: Apache-2.0
"""LoRA through Hugging Face peft for ``Booster.enable_lora`` and ``save_lora_as_pretrained`` (peft is optional:
a missing peft raises an ``ImportError`` that names ``pip install peft``)."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from torch import nn

from stepforge.core import WrappedModel

from .boosted_model import ModelWrapper

__all__ = ["require_peft", "enable_lora", "peft_model_of"]


def require_peft(what: str) -> None:
    """Raise an ``ImportError`` naming the install command when peft is missing."""
    if importlib.util.find_spec("peft") is None:
        raise ImportError(f"{what} needs Hugging Face peft for LoRA: pip install peft")


def enable_lora(
    model: nn.Module, pretrained_dir: str | os.PathLike[str] | None = None, lora_config: Any = None
) -> nn.Module:
    """``peft.get_peft_model(model, lora_config)``, or with ``pretrained_dir`` the adapters saved there
    (``PeftModel.from_pretrained(..., is_trainable=True)``); a missing peft, config or a boosted model raises.
    """
    require_peft("Booster.enable_lora")
    from peft import LoraConfig, PeftModel, get_peft_model

    if isinstance(model, ModelWrapper):
        raise ValueError(
            "Booster.enable_lora: call it on the model before boost(), not on the boosted model."
        )
    if pretrained_dir is None:
        if lora_config is None:
            raise ValueError(
                "Booster.enable_lora: pass lora_config=peft.LoraConfig(...) (or pretrained_dir, a saved adapter)."
            )
        if not isinstance(lora_config, LoraConfig):
            raise TypeError(
                f"Booster.enable_lora: lora_config must be a peft.LoraConfig, got {type(lora_config).__name__}."
            )
        peft_model: nn.Module = get_peft_model(model, lora_config)
        return peft_model
    loaded: nn.Module = PeftModel.from_pretrained(model, str(pretrained_dir), is_trainable=True)
    return loaded


def peft_model_of(model: nn.Module) -> Any:
    """The ``peft.PeftModel`` inside a boosted (or plain) model, under the Booster's ``ModelWrapper`` or a
    plugin's own :class:`stepforge.core.WrappedModel`; ``ValueError`` when it has no LoRA adapters."""
    require_peft("save_lora_as_pretrained")
    from peft import PeftModel

    inner = model.unwrap(unwrap_peft=False) if isinstance(model, ModelWrapper) else model
    # a plugin's own wrapper (stepforge-zero's LowLevelZeroModel) holds the PeftModel inside
    for _ in range(8):
        if isinstance(inner, PeftModel) or not isinstance(inner, WrappedModel):
            break
        inner = inner.unwrap()
    if not isinstance(inner, PeftModel):
        raise ValueError(
            "save_lora_as_pretrained: the model has no LoRA adapters; call booster.enable_lora(model, "
            "lora_config=...) before boost()."
        )
    return inner
