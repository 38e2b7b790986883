# SPDX-License-Identifier: Apache-2.0
"""``ModelWrapper``: the model ``Booster.boost`` returns (ColossalAI's; a
:class:`stepforge.core.WrappedModel`), and the LoRA helpers."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from stepforge.core import WrappedModel
from stepforge.core.torch_compat import fsdp2_module_type

__all__ = ["ModelWrapper", "enable_lora", "peft_model_of", "plugin_module", "require_peft"]


class ModelWrapper(nn.Module):
    """Wrap ``module``, the plugin's model (DDP, FSDP2 or plain), for the Booster."""

    def __init__(self, module: nn.Module) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"ModelWrapper: module must be a torch.nn.Module, got {type(module).__name__}.")
        super().__init__()
        self.module = module

    def unwrap(self, unwrap_peft: bool = True) -> nn.Module:
        """The user's model: nested wrappers and DDP removed; with ``unwrap_peft`` a peft ``PeftModel`` gives its
        base model (the LoRA layers stay in it, under peft's names)."""
        inner = self.module
        model = inner.unwrap(unwrap_peft) if isinstance(inner, ModelWrapper) else inner
        if isinstance(model, DistributedDataParallel):
            model = model.module
        if unwrap_peft and _is_peft_model(model):
            peft_model: Any = model  # a peft.PeftModel (peft is optional: no static type for it)
            base: nn.Module = peft_model.get_base_model()
            return base
        return model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def state_dict(self, *args: Any, only_rank_0: bool | None = None, **kwargs: Any) -> Any:
        """``nn.Module.state_dict`` (keys prefixed ``module.``); an FSDP2 module gives its full state
        (collective), as FSDP1 and ``GeminiDDP`` did. With ``only_rank_0`` the plugin's module answers
        (ColossalAI's ``GeminiDDP.state_dict``)."""
        plugin_state_dict: Callable[..., Any] = self.module.state_dict  # a plugin's, with only_rank_0
        if only_rank_0 is not None:
            return plugin_state_dict(*args, only_rank_0=only_rank_0, **kwargs)
        fsdp2 = fsdp2_module_type()
        if args or kwargs or fsdp2 is None or not isinstance(self.module, fsdp2):
            return super().state_dict(*args, **kwargs)
        return {f"module.{key}": value for key, value in plugin_state_dict().items()}


def _is_peft_model(model: nn.Module) -> bool:
    if importlib.util.find_spec("peft") is None:
        return False
    from peft import PeftModel

    return isinstance(model, PeftModel)


def plugin_module(model: nn.Module) -> nn.Module:
    """What the plugin prepared: ``model.module`` for a :class:`ModelWrapper` (any nesting), else ``model``."""
    while isinstance(model, ModelWrapper):
        model = model.module
    return model


def require_peft(what: str) -> None:
    """Raise an ``ImportError`` naming the install command when peft is missing."""
    if importlib.util.find_spec("peft") is None:
        raise ImportError(f"{what} needs Hugging Face peft for LoRA: pip install peft")


def enable_lora(
    model: nn.Module, pretrained_dir: str | os.PathLike[str] | None = None, lora_config: Any = None
) -> nn.Module:
    """``peft.get_peft_model(model, lora_config)``, or the adapters saved in ``pretrained_dir``; a missing
    peft, config or a boosted model raises."""
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
