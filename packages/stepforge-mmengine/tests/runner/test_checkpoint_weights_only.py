# SPDX-License-Identifier: Apache-2.0
"""A FlexibleRunner checkpoint's shared objects (meta extras, message hub, schedulers, accumulation counters)
load under torch.load(weights_only=True); one process, launcher "none".

The blob is read the way stepforge.strategy's checkpoint layout stores it (a DCP ``objects`` bytes entry).
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _runs import example_config
from mmengine.runner import FlexibleRunner

from stepforge.mmengine import PLAIN_FORMAT, message_hub_from_plain

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


def test_single_process_checkpoint_objects_load_with_weights_only(tmp_path):
    cfg = example_config(
        work_dir=str(tmp_path),
        experiment_name="weights-only",
        launcher="none",
        strategy=dict(type="StepforgeStrategy"),
        train_cfg=dict(by_epoch=False, max_iters=4),
        default_hooks=dict(checkpoint=dict(type="CheckpointHook", interval=4, by_epoch=False)),
    )
    runner = FlexibleRunner.from_cfg(cfg)
    runner.train()
    assert runner.world_size == 1 and runner.distributed is False
    path = tmp_path / "iter_4.pth"
    state = {"objects": b""}
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    objects = torch.load(io.BytesIO(state["objects"]), weights_only=True)  # torch's default allow-list only
    hub = objects["extra"]["message_hub"]
    assert hub["format"] == PLAIN_FORMAT
    losses = message_hub_from_plain(hub)["log_scalars"]["train/loss"].data[0]
    expected = runner.message_hub.get_scalar("train/loss").data[0]
    assert len(expected) == 4
    assert torch.equal(torch.from_numpy(losses), torch.from_numpy(expected))
