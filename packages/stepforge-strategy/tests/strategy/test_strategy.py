# SPDX-License-Identifier: Apache-2.0
"""Strategy on one process: environment, prepare, LR scaling, compile, checkpoint arguments, exact resume, misuse."""

from __future__ import annotations

import os

import pytest
import torch
from _strategy_cases import COUNTS, ITERS, batch, full_params, make_model, make_strategy, prepare, train
from torch import nn

from stepforge.core import StepforgeError
from stepforge.strategy import ColossalAIStrategy, Strategy
from stepforge.strategy.checkpoint import CheckpointError, find_latest_checkpoint, verify_dir


def test_two_strategies_env_logging_and_prepare(tmp_path):
    a = make_strategy(str(tmp_path / "a"), seed=11)
    b = make_strategy(str(tmp_path / "b"), seed=None)
    assert a.seed == 11 and isinstance(b.seed, int) and a.world_size == 1 and a.plugin_name == "single"
    assert a.experiment_name == f"case_{a.timestamp}"
    a.logger.info("hello from a")
    assert os.path.isfile(a.log_file) and a.log_file == os.path.join(
        str(tmp_path / "a"), a.timestamp, f"{a.timestamp}.log"
    )
    with open(a.log_file, encoding="utf-8") as f:
        assert "hello from a" in f.read()
    model, wrapper, scheds = prepare(a)
    assert prepare(a) == (model, wrapper, scheds)  # idempotent: the same objects
    assert type(wrapper).__name__ == "ColossalAIOptimWrapper" and wrapper.booster is a.booster
    assert wrapper.accumulative_counts == COUNTS and len(scheds) == 2
    only_model = b.prepare(make_model(0))
    assert isinstance(only_model, nn.Module)
    b2 = make_strategy(str(tmp_path / "c"))
    pair = b2.prepare(make_model(0), optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.1)))
    assert len(pair) == 2
    for s in (a, b, b2):
        s.close()


def test_auto_scale_lr_counts_accumulation(tmp_path):
    s = make_strategy(str(tmp_path), auto_scale_lr=dict(base_batch_size=16))
    _, wrapper = s.prepare(
        make_model(0),
        optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.8), accumulative_counts=2),
        dispatch_kwargs=dict(max_iters=4, train_micro_batch_size_per_gpu=4),
    )
    assert wrapper.param_groups[0]["lr"] == pytest.approx(0.8 * 1 * 4 * 2 / 16)
    s2 = make_strategy(str(tmp_path), auto_scale_lr=dict(base_batch_size=16))
    with pytest.raises(ValueError, match="train_micro_batch_size_per_gpu"):
        s2.prepare(make_model(0), optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.8)))
    with pytest.raises(ValueError, match="base_batch_size"):
        make_strategy(str(tmp_path), auto_scale_lr=dict(enable=True))


def test_compile_is_applied(tmp_path):
    import torch._dynamo

    torch._dynamo.reset()
    s = make_strategy(str(tmp_path))
    model = s.prepare(make_model(0), compile=dict(backend="eager"))
    model.eval()
    x = torch.randn(3, 8)
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    out = model(x)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > before  # dynamo really traced it
    ref = make_model(0).eval()
    assert torch.equal(out, ref(x))
    assert list(model.state_dict()) == list(ref.state_dict())  # keys unchanged by compile


class _Position:
    def __init__(self, value: int = 0) -> None:
        self.value = value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


def test_exact_resume_mid_window_single(tmp_path):
    """2N iterations == N, save (inside a window), fresh objects, resume, N: bitwise (fp32, single)."""
    work = str(tmp_path)
    ref = make_strategy(work)
    prepare(ref)
    ref_losses = train(ref, 0, ITERS, 0)
    half = 4  # 4 % COUNTS != 0: the save falls inside a window
    first = make_strategy(work)
    prepare(first)
    losses = train(first, 0, half, 0)
    first.register_for_checkpointing("data", _Position(half))
    first.register_for_checkpointing("mine", _Position(40 + half), per_rank=True)
    path = first.save_checkpoint("iter_4", extra_ckpt=dict(note="x", meta=dict(epoch=0)))
    torch.manual_seed(1234)  # disturb the global RNG: resume must restore it (dropout)
    second = make_strategy(work, seed=99)
    prepare(second, model_seed=5)
    data, mine = _Position(), _Position()
    second.register_for_checkpointing("data", data)
    second.register_for_checkpointing("mine", mine, per_rank=True)
    with pytest.raises(TypeError, match="state_dict"):
        second.register_for_checkpointing("bad", object())
    with pytest.warns(UserWarning, match="seed"):
        ck = second.resume(path)
    assert (data.value, mine.value) == (half, 40 + half)
    assert ck["note"] == "x" and ck["meta"]["iter"] == half and ck["meta"]["mid_window"] is True
    assert second.dispatch_kwargs["cur_iter"] == half
    losses += train(second, half, ITERS, 0)
    assert losses == ref_losses
    got, want = full_params(second.model), full_params(ref.model)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert second.optim_wrapper.param_groups[0]["lr"] == ref.optim_wrapper.param_groups[0]["lr"]


def test_checkpoint_arguments(tmp_path):
    work = str(tmp_path)
    s = make_strategy(work)
    prepare(s)
    train(s, 0, 3, 0)
    seen = {}

    def on_save(ck):
        seen["keys"] = sorted(ck)
        ck["meta"]["tag"] = "from-callback"
        ck["blob"] = torch.ones(2)

    p1 = s.save_checkpoint("a", callback=on_save, extra_ckpt=dict(extra=1), max_keep_ckpts=2)
    assert seen["keys"] == ["extra", "meta", "optimizer", "param_schedulers", "state_dict"]
    assert verify_dir(p1)["meta"]["tag"] == "from-callback" and verify_dir(p1)["meta"]["iter"] == 3
    p2 = s.save_checkpoint(
        os.path.join(work, "b"), save_optimizer=False, save_param_scheduler=False, max_keep_ckpts=2
    )
    s.save_checkpoint("c", max_keep_ckpts=2)
    assert (
        not os.path.exists(p1)
        and os.path.isdir(p2)
        and find_latest_checkpoint(work) == os.path.join(work, "c")
    )
    assert s.find_latest_checkpoint() == os.path.join(work, "c")
    # a checkpoint without optimizer state cannot resume the optimizer, and says so without touching anything
    t = make_strategy(work)
    prepare(t, model_seed=3)
    before = full_params(t.model)
    with pytest.raises(CheckpointError, match="missing"):
        t.resume(p2)
    assert all(torch.equal(v, full_params(t.model)[k]) for k, v in before.items())
    t.resume(p2, resume_optimizer=False, resume_param_scheduler=False)
    assert all(torch.equal(v, full_params(s.model)[k]) for k, v in full_params(t.model).items())
    # load_checkpoint: map_location, revise_keys, strict, callback
    s.save_checkpoint("d", extra_ckpt=dict(blob=torch.ones(2)))

    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model(9)
            self.head = nn.Linear(4, 1)

    u = make_strategy(work)
    u.prepare(Wrapped())
    with pytest.raises(CheckpointError, match="strict=True"):
        u.load_checkpoint(os.path.join(work, "d"), strict=True, revise_keys=[(r"^", "net.")])
    got = {}
    ck = u.load_checkpoint(
        os.path.join(work, "d"),
        map_location="meta",
        revise_keys=[(r"^", "net.")],
        callback=lambda c: got.update(c),
    )
    assert ck["blob"].device.type == "meta" and "state_dict" in got
    want = full_params(s.model)
    assert all(torch.equal(u.model.net.state_dict()[k], want[k]) for k in want)


def test_misuse_errors(tmp_path):
    work = str(tmp_path)
    with pytest.raises(ValueError, match="env_kwargs: unknown key"):
        Strategy(work_dir=work, env_kwargs=dict(lanucher="none"))
    with pytest.raises(ValueError, match="launcher"):
        Strategy(work_dir=work, env_kwargs=dict(launcher="slurm"))
    with pytest.raises(ValueError, match="randomness"):
        Strategy(work_dir=work, env_kwargs=dict(randomness=dict(sed=1)))
    with pytest.raises(StepforgeError, match="no_such_plugin"):
        Strategy(work_dir=work, plugin="no_such_plugin")
    s = make_strategy(work)
    with pytest.raises(RuntimeError, match="prepare"):
        s.save_checkpoint("x")
    with pytest.raises(RuntimeError, match="prepare"):
        s.resume("x")
    with pytest.raises(ValueError, match="max_iters"):
        s.prepare(
            make_model(0), optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.1), accumulative_counts=2)
        )
    s = make_strategy(work)
    with pytest.raises(ValueError, match="ColossalAIOptimWrapper"):
        s.prepare(make_model(0), optim_wrapper=dict(type="OptimWrapper", optimizer=dict(type="SGD", lr=0.1)))
    s = make_strategy(work)
    with pytest.raises(ValueError, match="needs an optim_wrapper"):
        s.prepare(make_model(0), param_scheduler=dict(type="LinearLR", end=3))
    with pytest.raises(TypeError, match="nn.Module"):
        make_strategy(work).prepare(dict(type="ResNet"))
    assert ColossalAIStrategy.__init__.__kwdefaults__["plugin"] == "gemini"
    x, _ = batch(0, 0)
    assert x.shape == (4, 8)
