# SPDX-License-Identifier: Apache-2.0
"""The saved meta holds the real epoch, and the ZeRO mid-window guard (``Plugin.mid_window_save_refusal``) fires
through ``Strategy.save_checkpoint`` on 2 gloo ranks for ``zero1`` and ``zero2``: a window whose micro-batches ran
under ``no_sync`` (the optim wrapper's ``optim_context``) is saved with its gradients and resumes bit for bit; a
window with a synchronised backward (the booster's own, bypassing the wrapper) is refused with an error naming the plugin and the fix, and nothing is
written."""

from __future__ import annotations

import os

import pytest
import torch
from _strategy_cases import ITERS, batch, full_params, make_strategy, prepare, train

from stepforge.strategy.checkpoint._layout import read_commit
from stepforge.testing.distributed import requires_gloo, run_distributed


@pytest.mark.parametrize(
    "dispatch, extra, expected",
    [
        (dict(epoch_length=2), None, 2),  # iteration 5 // 2
        (dict(epoch_length=2, epoch=7), None, 7),  # the loop's own counter
        (dict(epoch_length=2), dict(meta=dict(epoch=9)), 9),  # an mmengine runner's meta wins
        ({}, None, None),  # an iteration-based run without epoch_length: unknown, not a made-up 0
    ],
)
def test_the_meta_holds_the_epoch_of_the_run(tmp_path, dispatch, extra, expected):
    s = make_strategy(str(tmp_path))
    prepare(s)
    s.dispatch_kwargs.update(dispatch)
    train(s, 0, 5, 0)
    meta = read_commit(s.save_checkpoint("iter_5", extra_ckpt=extra))["meta"]
    assert meta["iter"] == 5 and meta["epoch"] == expected


def _zero_window(rank: int, world: int, work: str, stage: int) -> dict:
    from stepforge.core import PLUGINS

    PLUGINS.get(f"zero{stage}")  # stepforge-zero installed
    plugin = dict(type=f"zero{stage}", precision="fp32")
    out: dict = {}
    # 1. under optim_context (no_sync for the window's first micro-batches): saved mid-window, resumed exactly
    ref = make_strategy(os.path.join(work, "ref"), plugin=plugin)
    prepare(ref)
    train(ref, 0, 4, rank)  # window 2 holds one micro-batch (COUNTS=3)
    ref.save_checkpoint("mid")
    train(ref, 4, ITERS, rank)
    out["ref"] = full_params(ref.model)
    other = make_strategy(os.path.join(work, "ref"), plugin=plugin, seed=3)
    prepare(other, model_seed=5)
    with pytest.warns(UserWarning, match="seed"):
        other.resume(os.path.join(work, "ref", "mid"))
    train(other, 4, ITERS, rank)
    out["resumed"] = full_params(other.model)
    out["mid_window"] = read_commit(os.path.join(work, "ref", "mid"))["meta"]["mid_window"]
    # 2. a synchronised backward inside the window: the gradients are partly reduced into shards -> refused
    sync = make_strategy(os.path.join(work, "sync"), plugin=plugin)
    _, wrapper, _ = prepare(sync)
    train(sync, 0, 3, rank)
    train(sync, 3, 4, rank)  # one micro-batch of window 2, under no_sync (the wrapper's doing)
    x, y = batch(4, rank)
    # the booster's backward directly: a synchronised backward that reduces into the shards mid-window
    sync.booster.backward((sync.model(x) - y).square().mean(), wrapper.optimizer)
    try:
        sync.save_checkpoint("refused")
        out["refusal"] = None
    except ValueError as exc:
        out["refusal"] = str(exc)
    out["written"] = sorted(e for e in os.listdir(os.path.join(work, "sync")) if "refused" in e)
    return out


@pytest.mark.distributed
@requires_gloo
@pytest.mark.parametrize("stage", [1, 2])
def test_the_zero_mid_window_guard_saves_or_refuses_on_two_ranks(tmp_path, stage):
    pytest.importorskip("stepforge.zero")
    results = run_distributed(_zero_window, 2, str(tmp_path), stage, timeout=240)
    for out in results:
        assert out["mid_window"] is True
        assert out["ref"].keys() == out["resumed"].keys()
        assert all(torch.equal(out["ref"][k], out["resumed"][k]) for k in out["ref"])
        refusal = out["refusal"]
        assert refusal is not None and "accumulation window" in refusal
        assert f"stage {stage} already reduced part of this accumulation window" in refusal
        assert "save at a window boundary" in refusal
        assert out["written"] == []  # nothing on disk: the refusal comes before any file
