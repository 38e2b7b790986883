# SPDX-License-Identifier: Apache-2.0
"""Booster on one process (plugin ``single``): training, the five boosted objects, save/load, errors.

Reference: plain torch on the concatenated batch. Tolerances: accumulation over k micro-batches changes only
the summation order, so parameters agree to rtol 1e-5 / atol 1e-6 after 4 AdamW steps.
"""

from __future__ import annotations

import json

import pytest
import torch
from _cases import MICRO, boost, boosted_steps, make_model, make_optimizer, reference_run
from safetensors.torch import load_file
from torch.utils.data import DataLoader, TensorDataset

import stepforge.strategy._plugin_setup as plugin_setup
from stepforge.core import Registry, UnknownNameError
from stepforge.strategy import Booster, ModelWrapper, OptimizerWrapper, SinglePlugin, StatefulDataLoader


def test_single_plugin_with_accumulation_equals_the_concatenated_batch():
    k, steps = 3, 4
    _, model, wrapper = boost("single", k=k)
    losses = boosted_steps(model, wrapper, steps, rank=0, world=1, k=k)
    ref, ref_losses = reference_run(steps, rows=k * MICRO)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    assert losses == pytest.approx(ref_losses, rel=1e-5)


def test_boost_returns_the_five_wrapped():
    booster = Booster()  # no process group: the single plugin
    assert isinstance(booster.plugin, SinglePlugin)
    model = make_model()
    opt = make_optimizer(model.parameters())
    loader = DataLoader(TensorDataset(torch.arange(10.0)), batch_size=2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    crit = torch.nn.MSELoss()
    m, o, c, d, s = booster.boost(model, opt, crit, loader, sched)
    assert isinstance(m, ModelWrapper) and m.module is model and m.unwrap() is model
    assert c is crit and s is sched
    assert isinstance(o, OptimizerWrapper) and o.unwrap() is opt
    assert isinstance(d, StatefulDataLoader) and len(d) == 5
    with booster.no_sync(m, o):  # single: supported, nothing to skip
        pass


def test_save_model_writes_the_hf_layout(tmp_path):
    booster, model, _ = boost("single")
    booster.save_model(model, tmp_path / "one.safetensors", use_safetensors=True)
    plain = make_model(seed=7)
    plain.load_state_dict(load_file(str(tmp_path / "one.safetensors")))
    for p, q in zip(plain.parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q)
    # size-capped shards: every linear layer is > 0.0001 MiB, so each tensor group splits into files
    booster.save_model(model, tmp_path / "sharded", shard=True, size_per_shard=0.0005, use_safetensors=True)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert set(index["weight_map"]) == set(model.unwrap().state_dict())
    other = make_model(seed=3)
    booster.load_model(other, tmp_path / "sharded")
    for p, q in zip(other.parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q)
    # tied weights (one storage under two names) are written as two tensors
    tied = torch.nn.Sequential(torch.nn.Linear(3, 3, bias=False), torch.nn.Linear(3, 3, bias=False))
    tied[1].weight = tied[0].weight
    booster.save_model(tied, tmp_path / "tied.safetensors", use_safetensors=True)
    back = load_file(str(tmp_path / "tied.safetensors"))
    assert torch.equal(back["0.weight"], back["1.weight"]) and torch.equal(back["0.weight"], tied[0].weight)
    booster.save_model(model, tmp_path / "bin", shard=True, use_safetensors=False)
    assert (tmp_path / "bin" / "pytorch_model.bin").is_file()


def test_optimizer_and_scheduler_checkpoint_resume_identically(tmp_path):
    booster, model, wrapper = boost("single", k=2)
    sched = torch.optim.lr_scheduler.StepLR(wrapper.optimizer, 1, gamma=0.5)
    boosted_steps(model, wrapper, 2, 0, 1, 2)
    sched.step()
    booster.save_model(model, tmp_path / "m", shard=True)
    booster.save_optimizer(wrapper.optimizer, tmp_path / "o", use_async=True)
    booster.save_lr_scheduler(sched, tmp_path / "s.pt")
    booster.checkpoint_io._sync_io()  # ColossalAI's wait for the background writes (another object reads them)
    boosted_steps(model, wrapper, 2, 0, 1, 2, first_step=2)
    expected = [p.detach().clone() for p in model.parameters()]

    booster2, model2, wrapper2 = boost("single", k=2)
    sched2 = torch.optim.lr_scheduler.StepLR(wrapper2.optimizer, 1, gamma=0.5)
    booster2.load_model(model2, tmp_path / "m")
    booster2.load_optimizer(wrapper2.optimizer, tmp_path / "o")
    booster2.load_lr_scheduler(sched2, tmp_path / "s.pt")
    assert sched2.get_last_lr() == sched.get_last_lr()
    boosted_steps(model2, wrapper2, 2, 0, 1, 2, first_step=2)
    for p, q in zip(model2.parameters(), expected, strict=True):
        assert torch.equal(p, q)


def test_errors():
    booster, model, wrapper = boost("single")
    foreign = make_optimizer(make_model().parameters())
    with pytest.raises(ValueError, match="not returned by this Booster"):
        booster.save_optimizer(foreign, "unused")
    with pytest.raises(ValueError, match="gather_dtensor"):
        booster.save_model(model, "unused", gather_dtensor=False)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        booster.boost("not a model")
    with pytest.raises(TypeError, match="stepforge.core.Plugin"):
        Booster(plugin=object())
    with pytest.raises(ValueError, match="'type'"):
        Booster(plugin=dict(stage=2))
    with pytest.raises(RuntimeError, match="initialised process group"):
        Booster(plugin="torch_ddp").boost(make_model())
    with pytest.raises(RuntimeError, match="initialised process group"):
        Booster(plugin="torch_fsdp").boost(make_model())
    with pytest.raises(RuntimeError, match="'gemini' does not support no_sync"):
        Booster(plugin="gemini").no_sync(model)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        booster.load_model(model, "/nonexistent/path")
    with pytest.raises(FileNotFoundError, match="torch.distributed.checkpoint"):
        booster.load_optimizer(wrapper.optimizer, "/nonexistent/path")


def test_missing_plugin_package_gives_the_install_hint(monkeypatch):
    # a registry where stepforge-zero is not installed, whatever this venv holds
    empty = Registry("stepforge.no_such_group", "plugin", install_hints={"low_level_zero": "stepforge-zero",
                                                                        "zero2": "stepforge-zero"})  # fmt: skip
    monkeypatch.setattr(plugin_setup, "PLUGINS", empty)  # where the Booster builds its plugin
    for spec in ("low_level_zero", "zero2", dict(type="zero2", stage=2)):
        with pytest.raises(UnknownNameError, match="pip install stepforge-zero"):
            Booster(plugin=spec)


def test_plugin_names_resolve_through_the_registry():
    from stepforge.core import PLUGINS
    from stepforge.strategy import GeminiPlugin, TorchDDPPlugin, TorchFSDPPlugin

    for name, cls in [("single", SinglePlugin), ("ddp", TorchDDPPlugin), ("TorchDDPPlugin", TorchDDPPlugin),
                      ("torch_fsdp", TorchFSDPPlugin), ("fsdp", TorchFSDPPlugin), ("gemini", GeminiPlugin),
                      ("GeminiPlugin", GeminiPlugin)]:  # fmt: skip
        assert PLUGINS.get(name) is cls


def test_device_reaches_plugins_that_take_it_and_is_checked_against_those_that_do_not():
    assert Booster(plugin="single", device="cpu").plugin.device == torch.device("cpu")
    # zero2 keeps ColossalAI's signature (no device argument): the device it picks is checked, not passed on
    assert Booster(plugin="zero2", device="cpu").plugin.device.type == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"device='cuda', but plugin 'zero2' takes no device argument"):
            Booster(plugin="zero2", device="cuda")
