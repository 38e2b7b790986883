# SPDX-License-Identifier: Apache-2.0
"""FlexibleRunner + StepforgeStrategy on 2 gloo ranks: ZeRO-2, CPUAdam, accumulation, save and exact resume.

The example config (``examples/mmengine/zero2_cpuadam.py``) is trained three times in the same two processes:
uninterrupted for 24 iterations; stopped by an exception after iteration 12 (its CheckpointHook saved there);
and resumed with ``resume=True`` to iteration 24. The resumed run must train only iterations 12..23 and end
with bit-identical weights and the same loss history (the message hub came back through the checkpoint).
"""

from __future__ import annotations

import os

import pytest
import torch

from stepforge.testing.distributed import run_distributed

pytestmark = pytest.mark.distributed


def _train_crash_resume(rank: int, world_size: int, root: str) -> dict[str, object]:
    from _runs import Crash, counted_iters, example_config, module_state
    from mmengine.runner import FlexibleRunner

    hooks = [dict(type="CountIters")]
    full = FlexibleRunner.from_cfg(
        example_config(work_dir=os.path.join(root, "full"), experiment_name="full", custom_hooks=hooks)
    )
    full.train()
    full_state = module_state(full)
    full_losses = full.message_hub.get_scalar("train/loss").data[0].copy()
    full_iters = counted_iters(full)

    resume_dir = os.path.join(root, "resume")
    first = FlexibleRunner.from_cfg(
        example_config(
            work_dir=resume_dir,
            experiment_name="first",
            custom_hooks=[*hooks, dict(type="CrashAfterIter", at=12)],
        )
    )
    try:
        first.train()
    except Crash:
        pass
    else:
        raise AssertionError("the first run was meant to stop after iteration 12")
    first_state = module_state(first)
    # mmengine's CheckpointHook rewrites last_checkpoint on rank 0 only, in place (truncate, then write), after
    # the collective save returned: without this barrier rank 1 could read it empty
    torch.distributed.barrier()
    with open(os.path.join(resume_dir, "last_checkpoint")) as f:
        last = f.read().strip()

    second = FlexibleRunner.from_cfg(
        example_config(work_dir=resume_dir, experiment_name="second", custom_hooks=hooks, resume=True)
    )
    second.train()
    return {
        "full_state": full_state,
        "full_losses": torch.from_numpy(full_losses),
        "full_iters": full_iters,
        "first_state": first_state,
        "last_checkpoint": last,
        "second_state": module_state(second),
        "second_losses": torch.from_numpy(second.message_hub.get_scalar("train/loss").data[0].copy()),
        "second_iters": counted_iters(second),
        "second_lr": second.optim_wrapper.get_lr()["lr"][0],
        "full_lr": full.optim_wrapper.get_lr()["lr"][0],
        "logger": type(second.logger).__name__,
        "distributed": second.distributed,
    }


def test_zero2_cpuadam_accumulation_saves_and_resumes_bit_identically(tmp_path):
    results = run_distributed(_train_crash_resume, 2, str(tmp_path), timeout=240.0)
    for rank, out in enumerate(results):
        assert out["full_iters"] == list(range(24)), rank
        # the resumed run trained only the second half: it really started from the checkpoint
        assert out["second_iters"] == list(range(12, 24)), rank
        # a committed checkpoint directory (DCP), named by mmengine's CheckpointHook
        assert out["last_checkpoint"].endswith("iter_12.pth"), out["last_checkpoint"]
        assert os.path.isdir(out["last_checkpoint"])
        # training moved the weights between the checkpoint and the end
        assert any(not torch.equal(out["first_state"][k], out["full_state"][k]) for k in out["full_state"])
        for key, value in out["full_state"].items():
            assert torch.equal(out["second_state"][key], value), (rank, key)
        assert len(out["full_losses"]) == 24
        # the message hub came back from the checkpoint: rank 0's history up to the save, then this rank's own
        saved = results[0]["full_losses"][:12]
        assert torch.equal(out["second_losses"], torch.cat([saved, out["full_losses"][12:]])), rank
        assert out["second_lr"] == out["full_lr"]
        assert out["logger"] == "MMLogger"
        assert out["distributed"] is True
    # ZeRO-2 keeps full parameters on every rank: both ranks hold the same model
    for key, value in results[0]["full_state"].items():
        assert torch.equal(results[1]["full_state"][key], value), key
