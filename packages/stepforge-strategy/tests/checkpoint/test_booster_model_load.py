# SPDX-License-Identifier: Apache-2.0
"""``Booster.load_model`` refreshes a ZeRO optimizer's fp32 masters, and casts dtypes as torch's ``load_state_dict``.

Under ``zero2`` with bf16 working weights the optimizer steps fp32 master pieces and copies them back into the
model. Loading a checkpoint changed only the model, so the next ``step()`` -- even at lr 0 -- wrote the old
weights back. The Booster now calls the plugin's ``after_model_load`` (core's ``Plugin`` contract), which for
``LowLevelZeroPlugin`` is ColossalAI's ``update_master_params``. Expected values are the weights that were
saved (read back from the model before they were changed), bitwise: lr 0 changes nothing.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from stepforge.core import Plugin
from stepforge.strategy import Booster, OptimizerWrapper, Strategy
from stepforge.testing.distributed import requires_gloo, run_distributed


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))


def _weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _zero_lr_step(model: nn.Module, optimizer, rank: int) -> None:
    optimizer.zero_grad()
    optimizer.backward(model(torch.full((2, 6), float(rank + 1))).square().mean())
    optimizer.step()


def _load_then_step(rank: int, world: int, ckpt: str, precision: str) -> dict:
    # a small initial scale: an fp16 step must really run (2**32 overflows and is skipped)
    booster = Booster(plugin=dict(type="zero2", precision=precision, initial_scale=2**8))
    model = _model()
    model, opt, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.0))
    booster.save_model(model, ckpt)
    saved = _weights(model)
    with torch.no_grad():  # the weights drift away from the checkpoint (masters included)
        for p in model.parameters():
            p.add_(1.0)
    opt.update_master_params(model.unwrap())
    _zero_lr_step(model, opt, rank)
    drifted = _weights(model)
    booster.load_model(model, ckpt)
    loaded = _weights(model)
    _zero_lr_step(model, opt, rank)
    after_step = _weights(model)
    assert not opt.last_step_skipped
    return {"saved": saved, "drifted": drifted, "loaded": loaded, "after_step": after_step}


@requires_gloo
@pytest.mark.distributed
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_zero2_load_model_survives_the_next_step(tmp_path, precision):
    ckpt = str(tmp_path / "model.safetensors")
    for rank, out in enumerate(run_distributed(_load_then_step, 2, ckpt, precision, timeout=120)):
        assert not any(torch.equal(a, b) for a, b in zip(out["saved"], out["drifted"], strict=True))
        assert all(torch.equal(a, b) for a, b in zip(out["saved"], out["loaded"], strict=True)), rank
        # the defect: here the step wrote the drifted masters back
        assert all(torch.equal(a, b) for a, b in zip(out["saved"], out["after_step"], strict=True)), rank


class _RecordingPlugin(Plugin):
    name = "recording"

    def __init__(self) -> None:
        super().__init__(device="cpu")
        self.calls: list[tuple[nn.Module, list]] = []

    def prepare(self, model, optimizer=None, **kwargs):
        # the Booster wraps the optimizer for its mixed precision first (an OptimizerWrapper already)
        assert isinstance(optimizer, OptimizerWrapper)
        return model, optimizer

    def after_model_load(self, model, optimizers):
        self.calls.append((model, list(optimizers)))


def test_load_model_hands_the_plugin_the_optimizers_boosted_with_that_model(tmp_path):
    plugin = _RecordingPlugin()
    booster = Booster(plugin=plugin)
    first, second = _model(), _model()
    first, *_ = booster.boost(first, torch.optim.SGD(first.parameters(), lr=0.1))
    second, opt_b, *_ = booster.boost(second, torch.optim.SGD(second.parameters(), lr=0.1))
    bare = _model()
    with contextlib.chdir(tmp_path):
        booster.save_model(first, "m.safetensors")
        booster.load_model(second, "m.safetensors")
        booster.load_model(bare, "m.safetensors")
    assert len(plugin.calls) == 2
    # the plugin gets what it prepared (the ModelWrapper's .module), with the optimizer boosted beside it
    assert plugin.calls[0][0] is second.module and plugin.calls[0][1] == [opt_b]
    assert plugin.calls[1][0] is bare and plugin.calls[1][1] == []


def _strategy_load_then_step(rank: int, world: int, work_dir: str) -> dict:
    # the same defect through Strategy.load_checkpoint (weights only, the optimizer's state is not resumed)
    strategy = Strategy(
        plugin=dict(type="zero2", precision="bf16"), work_dir=work_dir, log_kwargs=dict(console=False)
    )
    model, wrapper = strategy.prepare(_model(), optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.0)))
    strategy.save_checkpoint("weights")
    saved = _weights(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    wrapper.optimizer.update_master_params(model)
    strategy.load_checkpoint(strategy.find_latest_checkpoint())
    loaded = _weights(model)
    wrapper.update_params(model(torch.full((2, 6), float(rank + 1))).float().square().mean())
    return {"saved": saved, "loaded": loaded, "after_step": _weights(model)}


@requires_gloo
@pytest.mark.distributed
def test_zero2_strategy_load_checkpoint_survives_the_next_step(tmp_path):
    for rank, out in enumerate(run_distributed(_strategy_load_then_step, 2, str(tmp_path), timeout=120)):
        assert all(torch.equal(a, b) for a, b in zip(out["saved"], out["loaded"], strict=True)), rank
        assert all(torch.equal(a, b) for a, b in zip(out["saved"], out["after_step"], strict=True)), rank


def _cast_loads(rank: int, world: int, root: str) -> dict:
    """An fp16 save (zero2's default precision) loads into fp32 and bf16 models, and an fp32 save into fp16; a
    shape mismatch is refused with the model unchanged."""
    import warnings

    from stepforge.strategy.checkpoint import CheckpointMismatchError

    out: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the note about fp16 on CPU
        booster = Booster(plugin="zero2")
        model, *_ = booster.boost(_model())
    booster.save_model(model, f"{root}/fp16.bin")
    out["fp16"] = _weights(model)
    for plugin in ("torch_fsdp", "torch_ddp", dict(type="zero2", precision="bf16")):
        booster = Booster(plugin=plugin)
        model, *_ = booster.boost(_model())
        booster.load_model(model, f"{root}/fp16.bin")
        out[str(plugin)] = [
            p.full_tensor() if hasattr(p, "full_tensor") else p for p in _weights(model.unwrap())
        ]
    booster = Booster(plugin="torch_ddp")
    booster.save_model(booster.boost(_model())[0], f"{root}/fp32.bin")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        booster = Booster(plugin="zero2")
        model, *_ = booster.boost(_model())
    booster.load_model(model, f"{root}/fp32.bin")
    out["fp32->fp16"] = _weights(model)
    # Strategy: a zero2 (fp16) checkpoint resumed under torch_ddp (fp32)
    for plugin in ("zero2", "torch_ddp"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            s = Strategy(plugin=plugin, work_dir=f"{root}/{plugin}", log_kwargs=dict(console=False))
            model, _ = s.prepare(_model(), optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.1)))
            if plugin == "zero2":
                s.save_checkpoint(f"{root}/strategy.ckpt")
            else:
                s.resume(f"{root}/strategy.ckpt")
                out["strategy"] = [p.detach().clone() for p in model.module.parameters()]
        s.close()
    wider = nn.Sequential(nn.Linear(6, 4), nn.Linear(4, 3))
    booster = Booster(plugin="torch_ddp")
    wide, *_ = booster.boost(wider)
    before = _weights(wide)
    try:
        booster.load_model(wide, f"{root}/fp16.bin")
    except CheckpointMismatchError as exc:
        out["refusal"] = str(exc)
    out["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, _weights(wide), strict=True))
    return out


@requires_gloo
@pytest.mark.distributed
def test_model_loads_cast_dtypes_as_torch_load_state_dict_does(tmp_path):
    got = run_distributed(_cast_loads, 2, str(tmp_path), timeout=240)[0]
    fp16 = got["fp16"]
    assert all(w.dtype == torch.float16 for w in fp16)
    for plugin, dtype in (("torch_fsdp", torch.float32), ("torch_ddp", torch.float32)):
        for loaded, saved in zip(got[plugin], fp16, strict=True):
            assert loaded.dtype == dtype and torch.equal(loaded, saved.to(dtype)), plugin
    bf16 = got[str(dict(type="zero2", precision="bf16"))]
    for loaded, saved in zip(bf16, fp16, strict=True):
        assert loaded.dtype == torch.bfloat16 and torch.equal(loaded, saved.to(torch.bfloat16))
    fp32 = [p.detach() for p in _model().parameters()]
    for loaded, saved in zip(got["fp32->fp16"], fp32, strict=True):
        assert loaded.dtype == torch.float16 and torch.equal(loaded, saved.to(torch.float16))
    for loaded, saved in zip(got["strategy"], fp16, strict=True):
        assert loaded.dtype == torch.float32 and torch.equal(loaded, saved.to(torch.float32))
    assert (
        "0.bias is torch.float16(5,) there and torch.float32(4,) here" in got["refusal"] and got["unchanged"]
    )
