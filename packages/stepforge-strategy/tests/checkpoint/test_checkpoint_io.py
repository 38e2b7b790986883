# SPDX-License-Identifier: Apache-2.0
"""``CheckpointIO`` / ``GeneralCheckpointIO``, written from ColossalAI's
``tests/test_checkpoint_io/test_general_checkpoint_io.py`` as explicit sequences:

save a model, an optimizer (after one Adam step, so it has state) and an lr scheduler, wait for the background
writes (``_sync_d2h``, ``_sync_io``), load into fresh objects and compare every tensor exactly; unsharded and
sharded, safetensors or not, synchronous or ``use_async``. Then the asynchronous contract: the write runs on
another thread after ``save_*`` returned, reads a staged copy (a weight change after the call is not in the
file), the next ``save_model`` waits for it, and a failed write raises at the wait.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from stepforge.strategy import Booster, BoosterCheckpointIO, CheckpointError, GeneralCheckpointIO
from stepforge.strategy.checkpoint import _model_io
from stepforge.strategy.checkpoint._model_io import is_safetensors
from stepforge.testing.distributed import requires_gloo, run_distributed

WAIT_S = 60  # bound on every wait for a background writer


def _trained(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    scheduler.step()
    return model, optimizer, scheduler


def _assert_same_model(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


def _assert_same_optimizer(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sorted(sa["state"]) == sorted(sb["state"]) == [0, 1, 2, 3]
    for index, entry in sa["state"].items():
        assert sorted(entry) == sorted(sb["state"][index]) == ["exp_avg", "exp_avg_sq", "step"]
        for name, value in entry.items():
            assert torch.equal(value, sb["state"][index][name]), (index, name)


@pytest.mark.parametrize("use_safetensors", [False, True])
@pytest.mark.parametrize("use_async", [False, True])
def test_unsharded_checkpoint(tmp_path, use_safetensors, use_async):
    model, optimizer, scheduler = _trained()
    io = GeneralCheckpointIO()
    io.save_model(model, tmp_path / "model.pt", use_safetensors=use_safetensors, use_async=use_async)
    io.save_optimizer(optimizer, tmp_path / "optimizer.pt", use_async=use_async)
    io.save_lr_scheduler(scheduler, tmp_path / "scheduler.pt")
    io._sync_d2h()
    io._sync_io()
    assert is_safetensors(tmp_path / "model.pt") == (use_safetensors or use_async)  # async writes safetensors

    new_model, new_optimizer, new_scheduler = _trained(seed=1)
    io.load_model(new_model, tmp_path / "model.pt")
    io.load_optimizer(new_optimizer, tmp_path / "optimizer.pt")
    io.load_lr_scheduler(new_scheduler, tmp_path / "scheduler.pt")
    _assert_same_model(model, new_model)
    _assert_same_optimizer(optimizer, new_optimizer)
    assert new_scheduler.state_dict() == scheduler.state_dict()


@pytest.mark.parametrize("use_safetensors", [False, True])
@pytest.mark.parametrize("use_async", [False, True])
def test_sharded_model_and_optimizer_checkpoint(tmp_path, use_safetensors, use_async):
    model, optimizer, _ = _trained()
    io = GeneralCheckpointIO()
    # ColossalAI's positional call: shard, gather_dtensor, prefix, size_per_shard (MiB)
    io.save_model(model, tmp_path / "model", True, True, "", 0.0001, use_safetensors=use_safetensors,
                  use_async=use_async)  # fmt: skip
    io.save_optimizer(optimizer, tmp_path / "optimizer", shard=True, size_per_shard=10, use_async=use_async)
    io._sync_d2h()
    io._sync_io()
    ext = "safetensors" if use_safetensors or use_async else "bin"
    assert len(list((tmp_path / "model").glob(f"*.{ext}"))) > 1  # 0.0001 MiB: several shards and an index
    assert len(list((tmp_path / "model").glob("*.index.json"))) == 1

    new_model, new_optimizer, _ = _trained(seed=1)
    io.load_model(new_model, tmp_path / "model", strict=True)
    io.load_optimizer(new_optimizer, tmp_path / "optimizer")
    _assert_same_model(model, new_model)
    _assert_same_optimizer(optimizer, new_optimizer)


def test_plugin_less_booster_saves_optimizers_boost_did_not_wrap(tmp_path):
    booster = Booster()
    assert isinstance(booster.checkpoint_io, GeneralCheckpointIO)
    _, optimizer, _ = _trained()
    booster.save_optimizer(optimizer, tmp_path / "plain.pt")
    _, fresh, _ = _trained(seed=1)
    fresh.state.clear()  # a fresh optimizer: every state entry must be created by the load
    booster.load_optimizer(fresh, tmp_path / "plain.pt")
    _assert_same_optimizer(optimizer, fresh)
    # an explicit plugin keeps the rule that optimizers come from its boost()
    explicit = Booster(plugin="single")
    assert type(explicit.checkpoint_io) is BoosterCheckpointIO
    with pytest.raises(ValueError, match="not returned by this Booster's boost"):
        explicit.save_optimizer(optimizer, tmp_path / "refused.pt")


def _boosted_sgd(booster: Booster):
    torch.manual_seed(0)
    net = nn.Linear(3, 2)
    return booster.boost(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.5))[:2]


def test_boosted_optimizer_async_save_is_pending_until_synced(tmp_path):
    booster = Booster()
    boosted, opt = _boosted_sgd(booster)
    opt.backward(boosted(torch.ones(1, 3)).sum())
    opt.step()
    booster.save_optimizer(opt, tmp_path / "optim", shard=True, use_async=True)
    assert len(booster.checkpoint_io.async_writers) == 1  # dcp.async_save's future, not yet waited on
    booster.checkpoint_io._sync_io()
    assert booster.checkpoint_io.async_writers == [] and (tmp_path / "optim" / ".metadata").is_file()
    other = Booster()
    _, fresh = _boosted_sgd(other)
    other.load_optimizer(fresh, tmp_path / "optim")
    for p, q in zip(opt.parameters, fresh.parameters, strict=True):
        assert torch.equal(opt.state[p]["momentum_buffer"], fresh.state[q]["momentum_buffer"])


class _GatedWriter:
    """Stands in for the model writer: records its thread and waits for the test's go before writing."""

    def __init__(self, fail: bool = False) -> None:
        self.go = threading.Event()
        self.started = threading.Event()
        self.thread: threading.Thread | None = None
        self.fail = fail

    def __call__(self, state, checkpoint, **kwargs):
        self.thread = threading.current_thread()
        self.started.set()
        assert self.go.wait(WAIT_S), "the test never released the writer"
        if self.fail:
            raise OSError("disk full")
        _real_write(state, checkpoint, **kwargs)


_real_write = _model_io.write_full_state_dict


def test_async_model_save_runs_in_the_background_on_a_staged_copy(tmp_path, monkeypatch):
    writer = _GatedWriter()
    monkeypatch.setattr(_model_io, "write_full_state_dict", writer)
    model = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 2.0]]))
    io = GeneralCheckpointIO()
    io.save_model(model, tmp_path / "m.safetensors", use_safetensors=True, use_async=True)
    assert writer.started.wait(WAIT_S) and writer.thread is not threading.current_thread()
    assert not (tmp_path / "m.safetensors").exists()  # save_model returned before the write
    io.synchronize()  # ColossalAI's point before the weights change: the state is already staged
    with torch.no_grad():
        model.weight.fill_(7.0)  # an optimizer step after the save call
    writer.go.set()
    io._sync_io()
    back = nn.Linear(2, 1, bias=False)
    io.load_model(back, tmp_path / "m.safetensors")
    assert back.weight.tolist() == [[1.0, 2.0]]  # the values at the save call


def test_the_next_save_waits_for_pending_writes_and_failures_raise(tmp_path, monkeypatch):
    writer = _GatedWriter()
    monkeypatch.setattr(_model_io, "write_full_state_dict", writer)
    model = nn.Linear(2, 1)
    io = GeneralCheckpointIO()
    io.save_model(model, tmp_path / "first", shard=True, use_async=True)
    assert writer.started.wait(WAIT_S)
    writer.go.set()
    monkeypatch.setattr(_model_io, "write_full_state_dict", _real_write)
    io.save_model(model, tmp_path / "second.bin")  # waits for "first" before writing
    assert io.async_writers == [] and (tmp_path / "first" / "model.safetensors").is_file()

    failing = _GatedWriter(fail=True)
    monkeypatch.setattr(_model_io, "write_full_state_dict", failing)
    io.save_model(model, tmp_path / "third", use_async=True)
    failing.go.set()
    with pytest.raises(CheckpointError, match="disk full"):
        io._sync_io()
    assert io.async_writers == [] and not Path(tmp_path / "third").exists()


def test_plain_optimizer_with_several_param_groups(tmp_path):
    model, _, _ = _trained()
    groups = [{"params": model[0].parameters(), "lr": 1e-2}, {"params": model[2].parameters(), "lr": 1e-3}]
    optimizer = torch.optim.Adam(groups)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    io = GeneralCheckpointIO()
    io.save_optimizer(optimizer, tmp_path / "optimizer", shard=True, prefix="run", use_async=True)
    io._sync_io()
    assert (tmp_path / "optimizer" / "run-pytorch_optim.bin.index.json").is_file()
    new_model, _, _ = _trained(seed=1)
    fresh = torch.optim.Adam(
        [{"params": new_model[0].parameters(), "lr": 0.5}, {"params": new_model[2].parameters(), "lr": 0.5}]
    )
    io.load_optimizer(fresh, tmp_path / "optimizer", prefix="run")
    assert [g["lr"] for g in fresh.param_groups] == [1e-2, 1e-3]
    _assert_same_optimizer(optimizer, fresh)


def _ddp_async_round_trip(rank: int, world: int, root: str) -> dict:
    booster = Booster(plugin="torch_ddp")
    torch.manual_seed(0)
    net = nn.Linear(3, 2)
    boosted, opt, *_ = booster.boost(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.5))
    opt.backward(boosted(torch.full((2, 3), float(rank + 1))).sum())
    opt.step()
    booster.save_model(boosted, f"{root}/model", shard=True, use_async=True)
    booster.save_optimizer(opt, f"{root}/optim", shard=True, use_async=True)
    pending = len(booster.checkpoint_io.async_writers)
    booster.checkpoint_io._sync_io()  # collective: every rank waits for rank 0's model write
    other = Booster(plugin="torch_ddp")
    torch.manual_seed(1)
    net2 = nn.Linear(3, 2)
    boosted2, opt2, *_ = other.boost(net2, torch.optim.SGD(net2.parameters(), lr=0.1, momentum=0.5))
    other.load_model(boosted2, f"{root}/model")
    other.load_optimizer(opt2, f"{root}/optim")
    same_weights = all(torch.equal(a, b) for a, b in zip(net.parameters(), net2.parameters(), strict=True))
    same_momentum = all(
        torch.equal(opt.state[a]["momentum_buffer"], opt2.state[b]["momentum_buffer"])
        for a, b in zip(opt.parameters, opt2.parameters, strict=True)
    )
    return {"pending": pending, "same_weights": same_weights, "same_momentum": same_momentum}


@requires_gloo
def test_async_saves_under_ddp_round_trip_on_every_rank(tmp_path):
    for rank_out in run_distributed(_ddp_async_round_trip, 2, str(tmp_path), timeout=180):
        assert rank_out == {"pending": 2, "same_weights": True, "same_momentum": True}
