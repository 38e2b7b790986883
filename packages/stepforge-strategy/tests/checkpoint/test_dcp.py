# SPDX-License-Identifier: Apache-2.0
"""The DCP checkpoint layer: commit marker, last_checkpoint, rotation, validation, crash in the middle of a save."""

from __future__ import annotations

import os

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from stepforge.strategy import checkpoint as ck
from stepforge.strategy.checkpoint import CheckpointError, find_latest_checkpoint
from stepforge.strategy.checkpoint._dcp import load_dir, save_dir
from stepforge.strategy.checkpoint._layout import MARKER, read_commit
from stepforge.testing.distributed import DistributedTestError, requires_gloo, run_distributed
from stepforge.testing.models import tanh_mlp


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _trained(seed: int, width: int = 6) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = tanh_mlp(4, width, 2, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(3, 4)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _save(path: str, model, opt, work_dir=None, max_keep=None, it=0) -> str:
    msd, osd = get_state_dict(model, opt)
    return save_dir(
        path,
        tensors={"model": msd, "optimizer": osd},
        objects={"note": "shared", "t": torch.arange(3)},
        rank_objects={"rank": 0},
        meta={"iter": it},
        work_dir=work_dir,
        max_keep_ckpts=max_keep,
    )


def _snapshot(model, opt):
    params = list(model.parameters())
    return [p.detach().clone() for p in params], {
        i: {n: v.clone() for n, v in opt.state[p].items()} for i, p in enumerate(params)
    }


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a[0], b[0], strict=True)) and all(
        torch.equal(a[1][k][n], b[1][k][n]) for k in a[1] for n in a[1][k]
    )


def test_round_trip_last_checkpoint_rotation_and_map_location(tmp_path):
    work = str(tmp_path)
    model, opt = _trained(0)
    paths = [
        _save(os.path.join(work, f"iter_{i}"), model, opt, work_dir=work, max_keep=2, it=i) for i in range(3)
    ]
    assert not os.path.exists(paths[0]) and all(os.path.isdir(p) for p in paths[1:])
    assert find_latest_checkpoint(work) == paths[2]
    assert _read(os.path.join(work, "last_checkpoint")) == paths[2]
    assert read_commit(paths[1])["meta"] == {"iter": 1}
    assert sorted(os.listdir(paths[2]))[0] == ".metadata" and MARKER in os.listdir(paths[2])
    # a fresh model/optimizer (one step so the optimizer has state to fill) gets the saved values bit for bit
    fresh, fopt = _trained(1)
    msd, osd = get_state_dict(fresh, fopt)
    shared, mine, meta = load_dir(paths[2], {"model": msd, "optimizer": osd}, map_location="meta")
    set_state_dict(fresh, fopt, model_state_dict=msd, optim_state_dict=osd)
    assert _same(_snapshot(fresh, fopt), _snapshot(model, opt))
    assert meta == {"iter": 2} and shared["note"] == "shared" and mine == {"rank": 0}
    assert shared["t"].device.type == "meta"  # map_location applies to the pickled objects
    # saving over an existing checkpoint replaces it only after the new one is committed
    _save(paths[2], fresh, fopt, work_dir=work, it=7)
    assert read_commit(paths[2])["meta"] == {"iter": 7}
    # last_checkpoint removed by hand: the newest committed checkpoint is still found
    os.remove(os.path.join(work, "last_checkpoint"))
    assert find_latest_checkpoint(work) == paths[2]
    assert find_latest_checkpoint(str(tmp_path / "nothing")) is None


def test_bad_checkpoints_raise_and_change_nothing(tmp_path):
    model, opt = _trained(0)
    good = _save(str(tmp_path / "good"), model, opt)
    other, oopt = _trained(3)
    before = _snapshot(other, oopt)

    def attempt(path):
        msd, osd = get_state_dict(other, oopt)
        with pytest.raises(CheckpointError) as info:
            load_dir(path, {"model": msd, "optimizer": osd})
        assert _same(_snapshot(other, oopt), before)
        return str(info.value)

    # 1. no marker: a save that never finished
    os.rename(os.path.join(good, MARKER), str(tmp_path / "marker"))
    assert "no COMMIT.json" in attempt(good)
    os.rename(str(tmp_path / "marker"), os.path.join(good, MARKER))
    # 2. a truncated data file
    data = next(f for f in os.listdir(good) if f.endswith(".distcp"))
    with open(os.path.join(good, data), "rb") as f:
        raw = f.read()
    with open(os.path.join(good, data), "wb") as f:
        f.write(raw[: len(raw) // 2])
    assert "truncated" in attempt(good)
    with open(os.path.join(good, data), "wb") as f:
        f.write(raw)
    # 3. another model: different width, and different names
    wide, wopt = _trained(0, width=8)
    assert "shape" in attempt(_save(str(tmp_path / "wide"), wide, wopt))
    renamed = torch.nn.Sequential(torch.nn.Linear(4, 2))
    ropt = torch.optim.AdamW(renamed.parameters())
    renamed(torch.randn(1, 4)).sum().backward()
    ropt.step()
    assert "missing" in attempt(_save(str(tmp_path / "renamed"), renamed, ropt))
    assert "does not exist" in attempt(str(tmp_path / "absent"))
    # and the intact checkpoint still loads
    msd, osd = get_state_dict(other, oopt)
    load_dir(good, {"model": msd, "optimizer": osd})


def _crash_mid_save(rank: int, world_size: int, work: str) -> None:
    model, opt = _trained(rank)  # different per rank: each rank's shard of "rank_objects" differs
    _save(os.path.join(work, "iter_1"), model, opt, work_dir=work, max_keep=1, it=1)

    def die_on_rank1(r: int) -> None:
        if r == 1:
            os._exit(17)

    ck._dcp._AFTER_WRITE_HOOK = die_on_rank1
    _save(os.path.join(work, "iter_2"), model, opt, work_dir=work, max_keep=1, it=2)


@requires_gloo
def test_kill_a_rank_mid_save_keeps_the_previous_checkpoint(tmp_path):
    work = str(tmp_path)
    with pytest.raises(DistributedTestError):
        run_distributed(_crash_mid_save, 2, work, timeout=60)
    first = os.path.join(work, "iter_1")
    assert find_latest_checkpoint(work) == first
    assert _read(os.path.join(work, "last_checkpoint")) == first
    assert not os.path.exists(os.path.join(work, "iter_2"))  # never renamed into place
    leftovers = [e for e in os.listdir(work) if e.startswith(".iter_2.tmp-")]
    assert leftovers and MARKER not in os.listdir(os.path.join(work, leftovers[0]))
    with pytest.raises(CheckpointError, match="never finished"):
        read_commit(os.path.join(work, leftovers[0]))["meta"]
    # the previous checkpoint (rotation with max_keep_ckpts=1 did not run) loads at world size 1
    model, opt = _trained(5)
    msd, osd = get_state_dict(model, opt)
    _, mine, meta = load_dir(first, {"model": msd, "optimizer": osd})
    assert meta == {"iter": 1} and mine == {"rank": 0}
