# SPDX-License-Identifier: Apache-2.0
"""``Strategy(resume="auto" | True | <path>)``: prepare() resumes the latest committed checkpoint of work_dir (after
removing what killed saves left), starts fresh when there is none, and refuses a bad value where it enters.

Two processes under torchrun with killed ranks: test_fault_restarts.py (beside this file).
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
from _strategy_cases import ITERS, full_params, make_strategy, prepare, train

from stepforge.strategy.checkpoint import CheckpointError, checkpoint_to_resume


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _leftovers(work: str) -> dict[str, str]:
    """What a save killed half-way leaves: a temporary directory (with shards, even a marker) and pointer file."""
    tmp = os.path.join(work, ".iter_5.tmp-0123abcd4567")
    os.makedirs(tmp)
    with open(os.path.join(tmp, "__0_0.distcp"), "wb") as f:
        f.write(b"half a shard")
    pointer = os.path.join(work, "last_checkpoint.tmp-4242")
    with open(pointer, "w", encoding="utf-8") as f:
        f.write("/nowhere")
    keep = os.path.join(work, ".notes.tmp-x")  # not the writer's shape (token is hex): left alone
    os.makedirs(keep)
    return dict(tmp=tmp, pointer=pointer, keep=keep)


def test_auto_starts_fresh_then_resumes_the_latest_and_cleans(tmp_path):
    work = str(tmp_path)
    ref = make_strategy(str(tmp_path / "ref"))
    prepare(ref)
    ref_losses = train(ref, 0, ITERS, 0)
    fresh = make_strategy(work, resume="auto")  # seeds the global RNG again (dropout), as ref's did
    prepare(fresh)
    assert fresh.resumed_from is None and "cur_iter" not in fresh.dispatch_kwargs
    losses = train(fresh, 0, 2, 0)
    fresh.save_checkpoint("iter_2")
    losses += train(fresh, 2, 4, 0)
    saved = fresh.save_checkpoint("iter_4")  # mid-window (COUNTS=3): the latest
    left = _leftovers(work)
    user_dir = os.path.join(work, "iter_9")  # a folder that is no checkpoint: ignored and kept
    os.makedirs(user_dir)

    again = make_strategy(work, seed=99, resume="auto")
    with pytest.warns(UserWarning, match="seed"):
        prepare(again, model_seed=5)
    assert again.resumed_from == saved and again.dispatch_kwargs["cur_iter"] == 4
    assert not os.path.exists(left["tmp"]) and not os.path.exists(left["pointer"])
    assert (
        os.path.isdir(left["keep"])
        and os.path.isdir(user_dir)
        and os.path.isdir(os.path.join(work, "iter_2"))
    )
    losses += train(again, 4, ITERS, 0)
    assert losses == ref_losses  # bitwise: the auto-resumed run continues the uninterrupted one
    assert _equal(full_params(again.model), full_params(ref.model))
    for s in (fresh, ref, again):
        s.close()


def test_resume_true_and_a_path(tmp_path):
    work = str(tmp_path)
    first = make_strategy(work)
    prepare(first)
    train(first, 0, 3, 0)
    path = first.save_checkpoint("iter_3")
    want = full_params(first.model)
    by_true = make_strategy(work, resume=True)  # mmengine's resume=True without load_from
    prepare(by_true, model_seed=5)
    by_path = make_strategy(str(tmp_path / "other"), resume=path)
    prepare(by_path, model_seed=5)
    for s in (by_true, by_path):
        assert s.resumed_from == path and s.dispatch_kwargs["cur_iter"] == 3
        assert _equal(full_params(s.model), want)
    loaded = make_strategy(str(tmp_path / "third"))
    prepare(loaded, model_seed=5)
    assert loaded.load_or_resume(resume="auto") is None  # its own work_dir has no checkpoint
    assert loaded.load_or_resume(load_from=path, resume="auto")["meta"]["iter"] == 3
    assert _equal(full_params(loaded.model), want)


def test_bad_resume_values(tmp_path):
    for bad in (1, None, "", 2.0):
        with pytest.raises(TypeError, match="resume must be"):
            make_strategy(str(tmp_path), resume=bad)
    missing = make_strategy(str(tmp_path), resume=str(tmp_path / "nope"))
    with pytest.raises(CheckpointError, match="does not exist"):
        prepare(missing)


def test_auto_removes_only_unfinished_saves(tmp_path, caplog):
    work = str(tmp_path)
    left = _leftovers(work)
    committed_copy = os.path.join(work, ".iter_1.old-89abcdef")  # a re-save's moved-aside copy: kept
    os.makedirs(committed_copy)
    logger = logging.getLogger("test_auto_resume")
    with caplog.at_level(logging.INFO, logger=logger.name):
        assert checkpoint_to_resume("auto", work, logger) is None
        assert checkpoint_to_resume("auto", str(tmp_path / "absent"), logger) is None
    removed = [r.getMessage() for r in caplog.records if "removed" in r.getMessage()]
    assert removed == [
        f"resume='auto': removed {path} (left by a save that did not finish)"
        for path in sorted([left["tmp"], left["pointer"]])
    ]
    assert sorted(os.listdir(work)) == [".iter_1.old-89abcdef", ".notes.tmp-x"]
