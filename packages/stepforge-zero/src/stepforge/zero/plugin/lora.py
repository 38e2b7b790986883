# SPDX-License-Identifier: Apache-2.0
"""LoRA under ZeRO: peft's adapter parameters join the optimizer that was built over the base model.

As ColossalAI's ``LowLevelZeroPlugin`` with LoRA: build the optimizer over ``model.parameters()``, then
``booster.enable_lora`` (peft freezes those and adds ``lora_A``/``lora_B`` layers), then ``boost``: each adapter
the optimizer does not hold joins the param group of its layer's frozen base weight (``<layer>.base_layer.*``).
Read from peft's parameter names alone (peft is not imported here).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

__all__ = ["ADAPTER_PREFIX", "add_adapters_to_optimizer"]

#: the first name component of peft's adapter layers (``lora_A``, ``lora_B``, ``lora_embedding_A``, ...)
ADAPTER_PREFIX = "lora_"

logger = logging.getLogger("stepforge.zero")


def add_adapters_to_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Append every trainable adapter parameter of ``model`` that ``optimizer`` does not hold to the param
    group of its layer's base weight; returns their names. An adapter whose base weight is not in the optimizer
    either stays out (logged on the ``stepforge.zero`` logger, as ColossalAI warns). Nothing changes for a
    model without adapters or an optimizer that already holds them."""
    held = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
    named = list(model.named_parameters())
    group_of_base: dict[str, int] = {}
    for name, param in named:
        if ".base_layer." in name and id(param) in held:
            layer = name[: name.index(".base_layer.") + len(".base_layer.")]
            group_of_base.setdefault(layer, held[id(param)])
    added: list[str] = []
    for name, param in named:
        # "<layer>.lora_A.<adapter>.weight" -> "<layer>.base_layer." (none for an adapter at the root)
        parts = name.split(".")
        at = next((i for i, part in enumerate(parts) if part.startswith(ADAPTER_PREFIX)), None)
        if not at or not param.requires_grad or id(param) in held:
            continue
        group = group_of_base.get(".".join(parts[:at]) + ".base_layer.")
        if group is None:
            logger.warning(
                "LoRA parameter %s: its base layer is not in the optimizer; it will not be trained", name
            )
            continue
        optimizer.param_groups[group]["params"].append(param)
        held[id(param)] = group
        added.append(name)
    return added
