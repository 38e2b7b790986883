# SPDX-License-Identifier: Apache-2.0
"""``ModelWrapper``: the model ``Booster.boost`` returns (ColossalAI's ``colossalai.interface.ModelWrapper``; it
implements :class:`stepforge.core.WrappedModel`). ``.module`` is what the plugin made of the model (DDP, an FSDP2
``FSDPModule``, the model itself), ``.unwrap()`` the user's model; as in ColossalAI, the wrapper's own
``state_dict()`` keys carry the ``module.`` prefix and ``unwrap().state_dict()`` the original ones."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from stepforge.core.torch_compat import fsdp2_module_type

__all__ = ["ModelWrapper", "plugin_module"]


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
        """``nn.Module.state_dict`` (keys prefixed ``module.``). An FSDP2 module (``torch_fsdp``, ``gemini``)
        gives its full state here too, a fresh snapshot, as FSDP1 and ``GeminiDDP`` did (collective). With
        ``only_rank_0`` (ColossalAI's ``GeminiDDP.state_dict``) the plugin's module answers: the full state with
        the original keys, on rank 0 only when ``True`` (the ``gemini``/``torch_fsdp`` modules support it;
        others raise ``TypeError``)."""
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
