# SPDX-License-Identifier: Apache-2.0
"""Verify, then apply: a resume that fails, in any way, leaves the live run exactly as it was.

The victim is a run in the middle of an accumulation window (gradients held, counters moved, optimizer stepped,
schedulers advanced, data position and RNG states set). Every failing resume must raise ``CheckpointError``
naming what differs, and a bitwise snapshot of everything a load may write (``_snapshot.snapshot``) must be
unchanged afterwards. A good checkpoint then loads and does change the snapshot, so the comparison can fail.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from _snapshot import Position, differences, snapshot
from _strategy_cases import COUNTS, ITERS, make_model, make_strategy, train
from torch import nn

from stepforge.strategy import CheckpointError
from stepforge.strategy.checkpoint._layout import MARKER
from stepforge.testing.distributed import requires_gloo, run_distributed

SCHEDULERS = [
    dict(type="LinearLR", start_factor=0.2, begin=0, end=3, by_epoch=False),
    dict(type="CosineAnnealingLR", eta_min=0.001, begin=3, end=ITERS, by_epoch=False),
]


def _prepare(s: Any, model: nn.Module, optimizer: Any = None, schedulers: int = 2) -> None:
    s.register_for_checkpointing("data", Position(11 + s.rank), per_rank=True)
    s.register_for_checkpointing("epoch", Position(2))
    s.prepare(
        model,
        optim_wrapper=dict(
            optimizer=optimizer or dict(type="AdamW", lr=0.05, weight_decay=0.01), accumulative_counts=COUNTS
        ),
        param_scheduler=SCHEDULERS[:schedulers],
        dispatch_kwargs=dict(max_iters=ITERS),
    )


def _saved(work: str, name: str, plugin: Any = None, rank: int = 0, stop: int = 3, **kw: Any) -> str:
    s = make_strategy(os.path.join(work, "src-" + name), plugin=plugin)
    model = kw.pop("model", None) or make_model(0)
    _prepare(s, model, **kw)
    train(s, 0, stop, rank)
    return s.save_checkpoint(os.path.join(work, name))


def _victim(work: str, plugin: Any = None, rank: int = 0, **kw: Any) -> Any:
    s = make_strategy(os.path.join(work, "victim"), plugin=plugin)
    _prepare(s, make_model(5), **kw)
    train(s, 0, COUNTS + 1, rank)  # one step taken, one micro-batch of the next window held in the gradients
    for obj, _ in s.statefuls.values():
        obj.at += 100
    random.random(), np.random.rand()  # every generator moved past the checkpoint's
    return s


def _copy(path: str, name: str) -> str:
    dst = os.path.join(os.path.dirname(path), name)
    shutil.copytree(path, dst)
    return dst


def _data_file(path: str) -> str:
    return os.path.join(path, sorted(n for n in os.listdir(path) if n.endswith(".distcp"))[0])


def _flip_middle(path: str) -> str:
    victim = _data_file(path)
    with open(victim, "r+b") as f:
        f.seek(os.path.getsize(victim) // 2)
        old = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([old[0] ^ 0xFF]))  # same size: only the checksum can tell
    return os.path.basename(victim)


def _truncate(path: str) -> str:
    victim = _data_file(path)
    os.truncate(victim, os.path.getsize(victim) // 2)
    return os.path.basename(victim)


def _remove(path: str) -> str:
    os.remove(os.path.join(path, ".metadata"))
    return ".metadata"


def _not_json(path: str) -> str:
    with open(os.path.join(path, MARKER), "w", encoding="utf-8") as f:
        f.write('{"format": "stepforge-dcp-2", "files": ')
    return MARKER


def _wrong_fields(path: str) -> str:
    with open(os.path.join(path, MARKER), "w", encoding="utf-8") as f:
        f.write('{"format": "stepforge-dcp-2", "files": 3, "meta": []}')
    return MARKER


_DAMAGE: dict[str, Callable[[str], str]] = {
    "same-size-corrupted-data": _flip_middle,
    "truncated-data": _truncate,
    "missing-metadata": _remove,
    "commit-not-json": _not_json,
    "commit-malformed": _wrong_fields,
}


def _wider(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, 32), nn.Dropout(0.25), nn.Tanh(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 4)
    )


def _other_keys(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _assert_refused(victim: Any, path: str, match: str, **kw: Any) -> None:
    before = snapshot(victim)
    with pytest.raises(CheckpointError, match=match):
        victim.resume(path, **kw)
    after = snapshot(victim)
    assert not differences(before, after), differences(before, after)


def test_a_good_checkpoint_changes_the_snapshot(tmp_path):
    good = _saved(str(tmp_path), "good")
    victim = _victim(str(tmp_path))
    before = snapshot(victim)
    victim.resume(good)
    changed = {re.match(r"\.(\w+)", d).group(1) for d in differences(before, snapshot(victim))}
    # the comparison sees every part a resume restores (so an untouched snapshot means untouched state)
    assert {
        "model",
        "params",
        "grads",
        "state",
        "groups",
        "schedulers",
        "window",
        "statefuls",
        "cur_iter",
    } <= (changed), changed
    assert {"rng_torch", "rng_numpy", "rng_python"} <= changed


@pytest.mark.parametrize("damage", sorted(_DAMAGE))
def test_a_damaged_checkpoint_changes_nothing(tmp_path, damage):
    good = _saved(str(tmp_path), "good")
    bad = _copy(good, "bad")
    name = _DAMAGE[damage](bad)
    victim = _victim(str(tmp_path))
    _assert_refused(victim, bad, name.replace(".", r"\."))
    victim.resume(good)  # the same run loads the undamaged original


def test_two_saved_schedulers_into_a_run_with_one_change_nothing(tmp_path):
    good = _saved(str(tmp_path), "good")
    _assert_refused(_victim(str(tmp_path), schedulers=1), good, "2 param schedulers, this run has 1")


@pytest.mark.parametrize(
    "model, match",
    [(_other_keys, "entries missing"), (_wider, r"shape \(32, 8\) there and \(16, 8\) here")],
    ids=["other-keys", "other-shapes"],
)
def test_a_foreign_model_changes_nothing(tmp_path, model, match):
    foreign = _saved(str(tmp_path), "foreign", model=model(0))
    _assert_refused(_victim(str(tmp_path)), foreign, match)


def test_another_optimizer_type_changes_nothing(tmp_path):
    sgd = _saved(str(tmp_path), "sgd", optimizer=dict(type="SGD", lr=0.05, momentum=0.9))
    _assert_refused(_victim(str(tmp_path)), sgd, "momentum_buffer|another optimizer type")


def test_another_parameter_count_changes_nothing(tmp_path):
    # same model, but the checkpoint's optimizer steps only the head (2 of the 6 parameters)
    s = make_strategy(os.path.join(str(tmp_path), "src"))
    model = make_model(0)
    _prepare(s, model, optimizer=torch.optim.AdamW(list(model.parameters())[-2:], lr=0.05))
    train(s, 0, 3, 0)
    path = s.save_checkpoint(os.path.join(str(tmp_path), "head-only"))
    _assert_refused(_victim(str(tmp_path)), path, "2 parameters there and 6 here")


# ---- 2 gloo ranks: ZeRO-2 and FSDP2, another world size (another plugin loads: one layout) ----


def _zero2() -> Any:
    return dict(type="zero2", precision="fp32")


def _gloo_saves(rank: int, world_size: int, work: str) -> None:
    _saved(work, "zero2", plugin=_zero2(), rank=rank)
    _saved(work, "zero2-mid", plugin=_zero2(), rank=rank, stop=COUNTS + 1)  # inside a window
    _saved(work, "zero2-foreign", plugin=_zero2(), rank=rank, model=_wider(0))
    _saved(work, "ddp", plugin="torch_ddp", rank=rank)
    _saved(work, "fsdp", plugin="torch_fsdp", rank=rank)


def _gloo_refusals(rank: int, world_size: int, work: str, bad: str) -> list[str]:
    victim = _victim(work, plugin=_zero2(), rank=rank)
    _assert_refused(victim, os.path.join(work, "zero2-foreign"), r"shape \(32, 8\) there")
    _assert_refused(victim, bad, r"__1_0\.distcp")
    fsdp = _victim(os.path.join(work, "f"), plugin="torch_fsdp", rank=rank)
    _assert_refused(fsdp, bad, r"__1_0\.distcp")
    victim.resume(os.path.join(work, "zero2"))  # and the good ones load, another plugin's too (one layout)
    victim.resume(os.path.join(work, "ddp"))
    fsdp.resume(os.path.join(work, "fsdp"))
    fsdp.resume(os.path.join(work, "zero2"))
    return ["ok"]


def _one_rank_refusal(rank: int, world_size: int, work: str) -> list[str]:
    victim = _victim(work, plugin=_zero2(), rank=rank)
    _assert_refused(victim, os.path.join(work, "zero2-mid"), "world size 2")
    return ["ok"]


@requires_gloo
def test_two_gloo_ranks_zero2_and_fsdp_refusals_change_nothing(tmp_path):
    work = str(tmp_path)
    run_distributed(_gloo_saves, 2, work, timeout=180)
    bad = _copy(os.path.join(work, "zero2"), "zero2-bad")
    path = os.path.join(bad, "__1_0.distcp")  # rank 1's shard: every rank must refuse, not only the reader
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        old = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([old[0] ^ 0x01]))
    assert run_distributed(_gloo_refusals, 2, work, bad, timeout=240) == [["ok"], ["ok"]]
    # saved inside a window at world size 2: its per-rank gradients do not map onto one rank
    assert run_distributed(_one_rank_refusal, 1, work, timeout=120) == [["ok"]]
