# SPDX-License-Identifier: Apache-2.0
"""The one writer's single-file saves: the path the user names is the save's. An existing file there, whoever
wrote it (ColossalAI's tests pass a ``NamedTemporaryFile``; a ``model.pt`` of an earlier tool), is replaced as
``torch.save`` and ColossalAI replace it, but atomically: a save that fails leaves the old bytes in place and no
temporary file. Directories the user did not name (the working directory, its parents, ``""``, ``"."``,
``".."``) stay refused, and nothing on disk changes when they are."""

from __future__ import annotations

import errno
import os

import pytest
import torch
from torch import nn

from stepforge.strategy import Booster, CheckpointError, GeneralCheckpointIO
from stepforge.strategy.checkpoint._layout import SIDECAR_SUFFIX, verify_file

OLD = b"bytes an earlier tool wrote"


def _snapshot(folder: str) -> dict[str, bytes]:
    out = {}
    for root, _, names in os.walk(folder):
        for name in names:
            full = os.path.join(root, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, folder)] = f.read()
    return out


def _trained(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
    model(torch.randn(3, 4)).square().mean().backward()
    optimizer.step()
    scheduler.step()
    return model, optimizer, scheduler


def _save(what: str, io: GeneralCheckpointIO, objects, path: str) -> None:
    model, optimizer, scheduler = objects
    if what == "model_safetensors":
        io.save_model(model, path, use_safetensors=True)
    elif what == "model_bin":
        io.save_model(model, path, use_safetensors=False)
    elif what == "optimizer":
        io.save_optimizer(optimizer, path, shard=False)
    else:
        io.save_lr_scheduler(scheduler, path)


def _assert_loads_back(what: str, io: GeneralCheckpointIO, objects, path: str) -> None:
    model, optimizer, scheduler = objects
    fresh_model, fresh_optimizer, fresh_scheduler = _trained(seed=1)
    if what.startswith("model"):
        io.load_model(fresh_model, path)
        for key, value in model.state_dict().items():
            assert torch.equal(value, fresh_model.state_dict()[key]), key
    elif what == "optimizer":
        io.load_optimizer(fresh_optimizer, path)
        for index, state in optimizer.state_dict()["state"].items():
            for name, value in state.items():
                assert torch.equal(value, fresh_optimizer.state_dict()["state"][index][name]), (index, name)
    else:
        io.load_lr_scheduler(fresh_scheduler, path)
        assert fresh_scheduler.state_dict() == scheduler.state_dict()


WHAT = ["model_safetensors", "model_bin", "optimizer", "lr_scheduler"]


@pytest.mark.parametrize("what", WHAT)
@pytest.mark.parametrize("existing", [b"", OLD])
def test_a_file_save_replaces_an_existing_file_the_user_named(tmp_path, what, existing):
    path = tmp_path / "target.file"
    path.write_bytes(existing)  # an empty NamedTemporaryFile, or a file an earlier tool wrote
    io, objects = GeneralCheckpointIO(), _trained(seed=0)
    _save(what, io, objects, str(path))
    assert path.read_bytes() != existing
    assert verify_file(str(path)) is not None  # checked against the manifest written with it
    assert sorted(os.listdir(tmp_path)) == ["target.file", "target.file" + SIDECAR_SUFFIX]
    _assert_loads_back(what, io, objects, str(path))
    # and the next save replaces this one, as before
    _save(what, io, objects, str(path))
    _assert_loads_back(what, io, objects, str(path))


@pytest.mark.parametrize("what", WHAT)
def test_a_failed_save_leaves_the_existing_file_whole(tmp_path, monkeypatch, what):
    import safetensors.torch

    path = tmp_path / "target.file"
    path.write_bytes(OLD)
    module, name = (safetensors.torch, "save_file") if what == "model_safetensors" else (torch, "save")
    real = getattr(module, name)

    def write_half_then_fail(obj, target, *args, **kwargs):
        real(obj, target, *args, **kwargs)
        with open(target, "r+b") as f:
            f.truncate(7)  # half a file is on disk when the error comes
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(module, name, write_half_then_fail)
    with pytest.raises(CheckpointError) as info:
        _save(what, GeneralCheckpointIO(), _trained(seed=0), str(path))
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.ENOSPC
    assert _snapshot(str(tmp_path)) == {"target.file": OLD}  # the old bytes, no temporary file, no manifest


@pytest.mark.parametrize("what", WHAT)
def test_directories_the_user_did_not_name_stay_refused(tmp_path, monkeypatch, what):
    work = tmp_path / "run"
    (work / "sub").mkdir(parents=True)
    (work / "sub" / "keep.txt").write_text("mine")
    monkeypatch.chdir(work)
    before = _snapshot(str(tmp_path))
    io, objects = GeneralCheckpointIO(), _trained(seed=0)
    names = ["", ".", "..", "sub/.."]
    if not what.startswith("model"):  # (a model named by a directory goes to model.safetensors inside it)
        names += [str(work), str(tmp_path), "sub"]  # a file save never replaces a directory, named or not
    for name in names:
        with pytest.raises((ValueError, CheckpointError), match="checkpoint"):
            _save(what, io, objects, name)
    assert _snapshot(str(tmp_path)) == before


def test_a_booster_with_a_plugin_replaces_model_and_scheduler_files_too(tmp_path):
    booster = Booster(plugin="single")
    model, optimizer, _ = _trained(seed=0)
    boosted, boosted_opt, *_ = booster.boost(model, optimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(boosted_opt, 1)
    for name in ("model.pt", "sched.pt"):
        (tmp_path / name).write_bytes(OLD)
    booster.save_model(boosted, str(tmp_path / "model.pt"))
    booster.save_lr_scheduler(scheduler, str(tmp_path / "sched.pt"))
    fresh, _, _ = _trained(seed=1)
    booster.load_model(fresh, str(tmp_path / "model.pt"))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters(), strict=True))
    assert torch.load(tmp_path / "sched.pt", weights_only=True) == scheduler.state_dict()
