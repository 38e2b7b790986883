# SPDX-License-Identifier: Apache-2.0
"""``GeneralCheckpointIO()`` on its own, as ColossalAI's ``tests/test_checkpoint_io/test_general_checkpoint_io.py``
uses it (its four functions written as explicit sequences, a small conv net with BatchNorm in place of resnet18):

save a model, a plain optimizer after an Adam step and an lr scheduler (unsharded into the ``NamedTemporaryFile``
paths that test passes; sharded into ``TemporaryDirectory`` paths with ``size_per_shard``), wait with
``_sync_d2h()`` and ``_sync_io()``, load into fresh objects and compare every tensor bitwise; safetensors or not,
synchronous or ``use_async``; several parameter groups; train on from the loaded state and round-trip again.
A sharded optimizer save has ColossalAI's layout: the param groups file, several state shards of at most
``size_per_shard`` MiB, and the index (``weight_map``: parameter index -> shard) written last."""

from __future__ import annotations

import json
import os
import tempfile

import pytest
import torch
from torch import nn

from stepforge.strategy import GeneralCheckpointIO
from stepforge.strategy.checkpoint import _optim_io


class _Net(nn.Module):
    """resnet18's kinds of state in small: conv weights, BatchNorm affine and running stats (int64 counter)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer1 = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU())
        self.layer2 = nn.Sequential(nn.Conv2d(8, 16, 3), nn.BatchNorm2d(16), nn.ReLU())
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.layer2(self.layer1(x)).mean((2, 3)))


X = torch.randn(2, 3, 12, 12, generator=torch.Generator().manual_seed(0))


def _net(seed: int) -> _Net:
    torch.manual_seed(seed)
    return _Net()


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int = 1) -> None:
    for _ in range(steps):
        model(X).sum().backward()
        optimizer.step()
        optimizer.zero_grad()


def _assert_equal(a, b, where: str = "") -> None:
    """Every entry equal, tensors bitwise (ColossalAI's check_state_dict_equal, without its tolerance)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for key in a:
            _assert_equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_equal(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    else:
        assert a == b, where


@pytest.mark.parametrize("use_safetensors", [True, False])
@pytest.mark.parametrize("use_async", [False, True])
def test_unsharded_checkpoint(tmp_path, use_safetensors, use_async):
    model = _net(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.001)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    _step(model, optimizer)
    scheduler.step()
    suffix = ".safetensors" if use_async or use_safetensors else ".bin"
    with (
        tempfile.NamedTemporaryFile(suffix=suffix, dir=tmp_path) as model_file,
        tempfile.NamedTemporaryFile(suffix=suffix if use_async else "", dir=tmp_path) as optimizer_file,
        tempfile.NamedTemporaryFile(dir=tmp_path) as scheduler_file,
    ):
        io = GeneralCheckpointIO()
        io.save_model(model, model_file.name, use_safetensors=use_safetensors, use_async=use_async)
        io.save_optimizer(optimizer, optimizer_file.name, use_async=use_async)
        io.save_lr_scheduler(scheduler, scheduler_file.name)
        new_model = _net(1)
        new_optimizer = torch.optim.Adam(new_model.parameters(), lr=0.001)
        new_scheduler = torch.optim.lr_scheduler.StepLR(new_optimizer, step_size=1, gamma=0.5)
        io._sync_d2h()
        io._sync_io()
        assert io.async_writers == []
        io.load_model(new_model, model_file.name)
        io.load_optimizer(new_optimizer, optimizer_file.name)
        io.load_lr_scheduler(new_scheduler, scheduler_file.name)
        _assert_equal(model.state_dict(), new_model.state_dict())
        _assert_equal(optimizer.state_dict(), new_optimizer.state_dict())
        _assert_equal(scheduler.state_dict(), new_scheduler.state_dict())


@pytest.mark.parametrize("use_safetensors", [True, False])
@pytest.mark.parametrize("use_async", [False, True])
def test_sharded_model_checkpoint(tmp_path, use_safetensors, use_async):
    model = _net(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.001)
    _step(model, optimizer)
    with tempfile.TemporaryDirectory(dir=tmp_path) as model_dir:
        io = GeneralCheckpointIO()
        # ColossalAI's positional call: shard, gather_dtensor, prefix, size_per_shard (MiB)
        io.save_model(
            model, model_dir, True, True, "", 0.002, use_safetensors=use_safetensors, use_async=use_async
        )
        io.save_optimizer(optimizer, str(tmp_path / "optimizer.bin"), shard=False)
        io._sync_d2h()
        io._sync_io()
        ext = "safetensors" if use_safetensors or use_async else "bin"  # asynchronous saves write safetensors
        assert len([n for n in os.listdir(model_dir) if n.endswith(f".{ext}")]) > 1
        new_model = _net(1)
        new_optimizer = torch.optim.Adam(new_model.parameters(), lr=0.001)
        io.load_model(new_model, model_dir, strict=True)
        io.load_optimizer(new_optimizer, str(tmp_path / "optimizer.bin"))
        _assert_equal(model.state_dict(), new_model.state_dict())
        _assert_equal(optimizer.state_dict(), new_optimizer.state_dict())


def _sharded_round_trip(tmp_path, model, optimizer, make_optimizer, use_async, size_per_shard=0.001):
    model_dir, optimizer_dir = tempfile.mkdtemp(dir=tmp_path), tempfile.mkdtemp(dir=tmp_path)
    io = GeneralCheckpointIO()
    io.save_model(model, model_dir, True, True, "", 10, use_safetensors=False)
    io.save_optimizer(
        optimizer, optimizer_dir, shard=True, size_per_shard=size_per_shard, use_async=use_async
    )
    io._sync_d2h()
    io._sync_io()
    new_model = _net(7)
    new_optimizer = make_optimizer(new_model)
    io.load_model(new_model, model_dir, strict=True)
    io.load_optimizer(new_optimizer, optimizer_dir)
    _assert_equal(model.state_dict(), new_model.state_dict())
    _assert_equal(optimizer.state_dict(), new_optimizer.state_dict())
    return optimizer_dir, new_model, new_optimizer


def _layout(optimizer_dir: str) -> tuple[list[str], dict]:
    with open(os.path.join(optimizer_dir, "pytorch_optim.bin.index.json"), encoding="utf-8") as f:
        index = json.load(f)
    shards = sorted(n for n in os.listdir(optimizer_dir) if n.startswith("pytorch_optim-"))
    return shards, index


@pytest.mark.parametrize("use_async", [False, True])
def test_sharded_optimizer_checkpoint(tmp_path, use_async):
    def make(model):
        return torch.optim.Adam(model.parameters(), lr=0.001)

    model = _net(0)
    optimizer = make(model)
    _step(model, optimizer)
    optimizer_dir, new_model, new_optimizer = _sharded_round_trip(tmp_path, model, optimizer, make, use_async)
    shards, index = _layout(optimizer_dir)
    assert len(shards) > 1 and sorted(set(index["weight_map"].values())) == shards  # size_per_shard honoured
    assert index["metadata"]["param_groups"] == "pytorch_optim_group.bin"
    assert sorted(int(k) for k in index["weight_map"]) == sorted(optimizer.state_dict()["state"])

    _step(new_model, new_optimizer, steps=5)  # train on from the loaded state, then round-trip again
    _sharded_round_trip(tmp_path, new_model, new_optimizer, make, use_async)


@pytest.mark.parametrize("use_async", [False, True])
def test_sharded_optimizer_multiple_param_groups(tmp_path, use_async):
    def make(model):
        groups = [{"params": model.layer1.parameters()}, {"params": model.layer2.parameters(), "lr": 0.002}]
        return torch.optim.Adam(groups, lr=0.001)

    model = _net(0)
    optimizer = make(model)
    _step(model, optimizer)
    optimizer_dir, _, new_optimizer = _sharded_round_trip(tmp_path, model, optimizer, make, use_async)
    assert [g["lr"] for g in new_optimizer.param_groups] == [0.001, 0.002]
    assert len(_layout(optimizer_dir)[0]) > 1


def test_sync_waits_for_the_background_writes_of_every_checkpoint_io(tmp_path, monkeypatch):
    """``_sync_io`` returns only when the file of an asynchronous save is complete; ``_sync_d2h`` exists on it."""
    import threading

    release = threading.Event()
    real = _optim_io.write_plain_optimizer

    def gated(*args, **kwargs):
        assert release.wait(60), "the test never released the writer"
        return real(*args, **kwargs)

    monkeypatch.setattr(_optim_io, "write_plain_optimizer", gated)
    model = _net(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _step(model, optimizer)
    io = GeneralCheckpointIO()
    io.save_optimizer(optimizer, str(tmp_path / "optim"), shard=True, use_async=True)
    io._sync_d2h()  # staging is done when save_optimizer returns: this does not wait for the write
    assert not (tmp_path / "optim").exists() and len(io.async_writers) == 1
    release.set()
    io._sync_io()
    assert (tmp_path / "optim" / "pytorch_optim.bin.index.json").is_file() and io.async_writers == []
