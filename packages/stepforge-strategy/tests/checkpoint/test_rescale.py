# SPDX-License-Identifier: Apache-2.0
"""A resume whose accumulation count changes with the global batch kept, in one process: the micro-batch size
changes (4 x 1 -> 2 x 2 samples per step), so ``accumulative_counts`` goes 4 -> 2 and the iteration counters are
halved; a checkpoint saved inside a window is refused at the new count before anything is applied. Without
``global_batch_size``, a resume that changes the global batch logs how to keep it."""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import pytest
import torch
from _strategy_cases import make_model, make_strategy

from stepforge.strategy.checkpoint import CheckpointMismatchError
from stepforge.strategy.checkpoint._strategy_ckpt import _note_global_batch


def _strategy(work: str, micro: int):
    s = make_strategy(work, global_batch_size=4)
    s.prepare(
        make_model(0),
        optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.1)),
        param_scheduler=[dict(type="LinearLR", start_factor=0.5, by_epoch=False, begin=0, end=100)],
        dispatch_kwargs=dict(train_micro_batch_size_per_gpu=micro, max_iters=40 // micro),
    )
    return s


def _iterate(s, n: int) -> None:
    model, wrapper, schedulers = s._components()
    for i in range(n):
        g = torch.Generator().manual_seed(i)
        with wrapper.optim_context(model):
            loss = model(torch.randn(1, 8, generator=g)).square().mean()
        wrapper.update_params(loss)
        for sched in schedulers:
            sched.step()


def test_counters_convert_at_a_window_boundary_and_a_mid_window_save_is_refused(tmp_path):
    first = _strategy(str(tmp_path / "a"), micro=1)  # accumulative_counts 4
    _iterate(first, 8)  # 2 optimizer steps
    boundary = first.save_checkpoint(str(tmp_path / "boundary"))
    _iterate(first, 2)  # half a window
    mid = first.save_checkpoint(str(tmp_path / "mid"))
    first.close()

    again = _strategy(str(tmp_path / "b"), micro=2)  # accumulative_counts 2
    _, wrapper, (sched,) = again._components()
    assert wrapper.accumulative_counts == 2
    before = {k: v.clone() for k, v in again.model.state_dict().items()}
    with pytest.raises(
        CheckpointMismatchError, match=r"2 micro-batch\(es\) into an accumulation window of 4"
    ):
        again.resume(mid)
    assert all(torch.equal(v, before[k]) for k, v in again.model.state_dict().items())  # nothing applied
    assert wrapper._window.inner_count == 0 and sched._global_step == 0
    ckpt = again.resume(boundary)
    window = wrapper._window
    assert (ckpt["meta"]["iter"], again.dispatch_kwargs["cur_iter"]) == (4, 4)  # 2 steps x 2
    assert (window.counts, window.inner_count, window.steps, window.max_counts) == (2, 4, 2, 20)
    assert (sched._global_step, sched.last_step) == (4, 4)  # this run's begin/end, the position converted
    assert ckpt["meta"]["global_batch_size"] == 4 and ckpt["meta"]["accumulative_counts"] == 4
    again.close()
    assert os.path.isdir(boundary)


def test_a_resume_that_changes_the_global_batch_says_how_to_keep_it(caplog):
    logger = logging.getLogger("test_rescale")
    run = SimpleNamespace(  # 3 ranks x micro-batch 1 x accumulative_counts 3 = 9
        dispatch_kwargs={"train_micro_batch_size_per_gpu": 1},
        optim_wrapper=SimpleNamespace(accumulative_counts=3),
        world_size=3,
        logger=logger,
    )
    with caplog.at_level(logging.WARNING, logger="test_rescale"):
        _note_global_batch(run, {"global_batch_size": 9, "world_size": 4})  # kept: silent
        _note_global_batch(run, {"global_batch_size": 12, "world_size": 3})  # same world size: silent
        _note_global_batch(run, {"global_batch_size": 12, "world_size": 4})
    assert [r.getMessage() for r in caplog.records] == [
        "resume: the global batch changes from 12 (world size 4) to 9 (world size 3); pass "
        "Strategy(global_batch_size=12) to keep it"
    ]
