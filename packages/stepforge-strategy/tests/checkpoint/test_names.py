# SPDX-License-Identifier: Apache-2.0
"""Name protection of every save (``_writer.check_target``): ``""``, ``"."``, ``".."``, ``work_dir``, its
ancestors and the working directory are refused with an error naming the argument, and nothing on disk changes; a
save that replaces a directory as a whole (a Strategy checkpoint, a DCP optimizer) refuses a folder or file
stepforge did not commit (a user's folder is never deleted)."""

from __future__ import annotations

import os

import pytest
import torch
from _strategy_cases import make_strategy, prepare, train
from test_writer_failures import _snapshot

from stepforge.strategy import Booster, CheckpointError
from stepforge.strategy.checkpoint._layout import read_commit


@pytest.fixture
def strategy(tmp_path, monkeypatch):
    work = tmp_path / "runs" / "exp"
    monkeypatch.chdir(tmp_path)
    s = make_strategy(str(work))
    prepare(s)
    train(s, 0, 3, 0)
    return s


@pytest.mark.parametrize(
    "name, error, match",
    [
        ("", ValueError, "filename must be a non-empty"),
        (".", ValueError, r"'\.' or '\.\.'"),
        ("..", ValueError, r"'\.' or '\.\.'"),
        ("sub/..", ValueError, r"'\.' or '\.\.'"),
        ("WORK", ValueError, "work_dir"),
        ("PARENT", ValueError, "parent directories"),
        ("CWD", ValueError, "parent directories"),
    ],
)
def test_a_strategy_save_refuses_names_that_would_replace_a_folder(tmp_path, strategy, name, error, match):
    work = strategy.work_dir
    name = {"WORK": work, "PARENT": os.path.dirname(work), "CWD": str(tmp_path)}.get(name, name)
    before = _snapshot(str(tmp_path))
    with pytest.raises(error, match=match):
        strategy.save_checkpoint(name)
    assert _snapshot(str(tmp_path)) == before
    assert os.path.isdir(work)


def test_a_users_folder_or_file_is_never_replaced(strategy):
    work = strategy.work_dir
    folder = os.path.join(work, "data")
    os.makedirs(folder)
    with open(os.path.join(folder, "keep.txt"), "w") as f:
        f.write("mine")
    with open(os.path.join(work, "notes"), "w") as f:
        f.write("mine too")
    uncommitted = os.path.join(work, "iter_9")  # a DCP directory without COMMIT.json (not a finished save)
    os.makedirs(uncommitted)
    with open(os.path.join(uncommitted, ".metadata"), "wb") as f:
        f.write(b"x")
    before = _snapshot(work)
    for name, what in (("data", "not a committed stepforge checkpoint"), ("notes", "an existing file")):
        with pytest.raises(CheckpointError, match=what) as info:
            strategy.save_checkpoint(name)
        assert "filename=" in str(info.value) and "Choose another name" in str(info.value)
    with pytest.raises(CheckpointError, match="not a committed stepforge checkpoint"):
        strategy.save_checkpoint("iter_9")
    assert _snapshot(work) == before
    # an empty folder holds nothing to lose; a committed checkpoint is replaced (after the new commit)
    os.makedirs(os.path.join(work, "empty"))
    assert read_commit(strategy.save_checkpoint("empty"))["meta"]["iter"] == 3
    assert read_commit(strategy.save_checkpoint("empty"))["meta"]["iter"] == 3


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


@pytest.mark.parametrize("shard", [False, True])
def test_booster_save_model_refuses_empty_and_dot_names(tmp_path, monkeypatch, shard):
    monkeypatch.chdir(tmp_path)
    booster, model = Booster(plugin="single"), _model()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "keep.txt").write_text("mine")
    (tmp_path / "model.pt").write_bytes(b"a file of the user")
    before = _snapshot(str(tmp_path))
    for bad in ("", ".", "..", "mine/.."):
        with pytest.raises(ValueError, match="checkpoint"):
            booster.save_model(model, bad, shard=shard)
    if shard:  # a sharded save names a directory: an existing file there is never turned into one
        with pytest.raises(
            CheckpointError, match="checkpoint='model.pt' is an existing file.*never replaced"
        ):
            booster.save_model(model, "model.pt", shard=True)
    assert _snapshot(str(tmp_path)) == before
    # its own earlier save is replaced
    booster.save_model(model, "own.pt", shard=shard)
    booster.save_model(model, "own.pt", shard=shard)


def test_booster_optimizer_and_scheduler_saves_refuse_the_working_directory_and_empty_names(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    booster = Booster(plugin="single")
    plain = _model()
    _, opt, *_ = booster.boost(plain, torch.optim.SGD(plain.parameters(), lr=0.1))
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "keep.txt").write_text("mine")
    before = _snapshot(str(tmp_path))
    with pytest.raises(ValueError, match="checkpoint="):
        booster.save_optimizer(opt, str(tmp_path), shard=True)
    with pytest.raises(ValueError, match="checkpoint="):
        booster.save_optimizer(opt, os.path.dirname(str(tmp_path)), shard=True)
    # a DCP optimizer save replaces its directory as a whole: a folder of the user's is never deleted
    with pytest.raises(CheckpointError, match="checkpoint='mine'.*not a committed stepforge checkpoint"):
        booster.save_optimizer(opt, "mine", shard=True)
    with pytest.raises(CheckpointError, match="checkpoint='mine' is an existing directory"):
        booster.save_lr_scheduler(sched, "mine")
    with pytest.raises(ValueError, match="empty"):
        booster.save_lr_scheduler(sched, "")
    assert _snapshot(str(tmp_path)) == before
