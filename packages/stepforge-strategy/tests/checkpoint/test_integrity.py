# SPDX-License-Identifier: Apache-2.0
"""Every file of a committed checkpoint is checksummed: one changed byte anywhere raises CheckpointError naming
the file, before the live model or optimizer is touched."""

from __future__ import annotations

import os

import pytest
import torch
from _strategy_cases import full_params, make_strategy, prepare, train

from stepforge.strategy import CheckpointError
from stepforge.strategy.checkpoint._layout import MARKER, read_commit


def _flip(path: str, offset: int) -> bytes:
    with open(path, "r+b") as f:
        f.seek(offset)
        old = f.read(1)
        f.seek(offset)
        f.write(
            bytes([old[0] ^ 0x01])
        )  # the smallest change: one bit, ASCII stays ASCII (COMMIT.json stays text)
    return old


def _restore(path: str, offset: int, old: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(old)


def _optimizer_state(strategy):
    opt = strategy.optim_wrapper.optimizer
    return [{k: v.clone() for k, v in opt.state[p].items()} for g in opt.param_groups for p in g["params"]]


def test_a_flipped_byte_in_any_file_is_refused_and_changes_nothing(tmp_path):
    work = str(tmp_path)
    s = make_strategy(work)
    prepare(s)
    train(s, 0, 3, 0)
    path = s.save_checkpoint("iter_3")
    victim = make_strategy(str(tmp_path / "victim"))
    prepare(victim, model_seed=4)
    train(victim, 0, 3, 0)  # optimizer state to protect
    params, state = full_params(victim.model), _optimizer_state(victim)
    lr = victim.optim_wrapper.param_groups[0]["lr"]
    names = sorted(os.listdir(path))
    assert MARKER in names and ".metadata" in names and any(n.endswith(".distcp") for n in names)
    for name in names:
        full = os.path.join(path, name)
        size = os.path.getsize(full)
        for offset in sorted({0, size // 3, size // 2, size - 1}):
            old = _flip(full, offset)
            with pytest.raises(CheckpointError) as info:
                victim.resume(path)
            assert name in str(info.value), (name, offset, str(info.value))
            _restore(full, offset, old)
            got = full_params(victim.model)
            assert all(torch.equal(params[k], got[k]) for k in params), (name, offset)
            now = _optimizer_state(victim)
            assert all(torch.equal(a[k], b[k]) for a, b in zip(state, now, strict=True) for k in a), (
                name,
                offset,
            )
            assert victim.optim_wrapper.param_groups[0]["lr"] == lr
    victim.resume(path)  # restored bytes: the checkpoint loads again, and holds the saved weights
    want = full_params(s.model)
    assert all(torch.equal(want[k], full_params(victim.model)[k]) for k in want)


def test_every_byte_of_the_commit_marker_is_covered(tmp_path):
    s = make_strategy(str(tmp_path))
    prepare(s)
    path = s.save_checkpoint("c")
    marker = os.path.join(path, MARKER)
    for offset in range(os.path.getsize(marker)):
        old = _flip(marker, offset)
        with pytest.raises(CheckpointError, match=MARKER):
            read_commit(path)["meta"]
        _restore(marker, offset, old)
    assert read_commit(path)["meta"]["iter"] == 0
