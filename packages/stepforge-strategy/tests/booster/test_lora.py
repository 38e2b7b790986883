# SPDX-License-Identifier: Apache-2.0
"""``Booster.enable_lora`` / ``save_lora_as_pretrained`` through Hugging Face peft, from ColossalAI's
``tests/test_lora/test_lora.py`` and its DDP plugin: adapters are added before ``boost``, only they train, the
saved adapter directory loads back into a fresh base model with equal LoRA weights; without peft the error
names ``pip install peft``; FSDP2 plugins refuse LoRA as ColossalAI's do.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from stepforge.strategy import Booster, ModelWrapper


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.proj(x)))


def test_missing_peft_names_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a)
    )
    booster = Booster(plugin="single")
    with pytest.raises(ImportError, match="pip install peft"):
        booster.enable_lora(_Net(), lora_config=object())
    with pytest.raises(ImportError, match="pip install peft"):
        booster.save_lora_as_pretrained(_Net(), "unused")


def test_lora_trains_only_the_adapters_and_round_trips(tmp_path):
    peft = pytest.importorskip("peft")  # in the strategy test group; a plain dev venv may lack it
    booster = Booster(plugin="single")
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["proj"], init_lora_weights=False)
    model = booster.enable_lora(_Net(), lora_config=config)
    base_before = {k: v.clone() for k, v in model.get_base_model().state_dict().items() if "lora_" not in k}
    boosted, opt, *_ = booster.boost(
        model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    )
    assert isinstance(boosted, ModelWrapper) and boosted.unwrap(unwrap_peft=False) is model
    assert boosted.unwrap() is model.get_base_model()
    lora_before = {k: v.clone() for k, v in model.state_dict().items() if "lora_" in k}
    assert sorted(lora_before) == [
        "base_model.model.proj.lora_A.default.weight",
        "base_model.model.proj.lora_B.default.weight",
    ]
    opt.backward(boosted(torch.ones(2, 4)).sum())
    opt.step()
    after = model.state_dict()
    assert all(not torch.equal(after[k], v) for k, v in lora_before.items())  # the adapters moved
    base_after = model.get_base_model().state_dict()
    assert all(torch.equal(base_after[k], v) for k, v in base_before.items())  # the base model did not

    booster.save_lora_as_pretrained(boosted, tmp_path / "adapter", use_safetensors=True)
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    again = booster.enable_lora(_Net(), pretrained_dir=tmp_path / "adapter")
    loaded = again.state_dict()
    for key in lora_before:
        assert torch.equal(loaded[key], after[key]), key


def test_lora_refusals():
    peft = pytest.importorskip("peft")
    booster = Booster(plugin="single")
    with pytest.raises(ValueError, match="lora_config"):
        booster.enable_lora(_Net())
    with pytest.raises(TypeError, match="peft.LoraConfig"):
        booster.enable_lora(_Net(), lora_config=dict(r=2))
    with pytest.raises(ValueError, match="quantize"):
        booster.enable_lora(_Net(), lora_config=peft.LoraConfig(target_modules=["proj"]), quantize=True)
    boosted = booster.boost(_Net())[0]
    with pytest.raises(ValueError, match="no LoRA adapters"):
        booster.save_lora_as_pretrained(boosted, "unused")
    with pytest.raises(ValueError, match="before boost"):
        booster.enable_lora(boosted, lora_config=peft.LoraConfig(target_modules=["proj"]))
    with pytest.raises(ValueError, match="does not support LoRA"):
        Booster(plugin="torch_fsdp").enable_lora(_Net(), lora_config=peft.LoraConfig(target_modules=["proj"]))
