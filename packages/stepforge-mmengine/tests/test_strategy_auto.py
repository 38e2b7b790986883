# SPDX-License-Identifier: Apache-2.0
"""An mmengine config with ``strategy=dict(type="StepforgeStrategy", plugin="auto", memory_budget=...)``: on 2
gloo ranks FlexibleRunner trains with the plugin chosen at prepare (the same on both ranks, logged with the
table); a budget nothing fits stops the run at prepare with the error naming what would fit."""

from __future__ import annotations

import os

import pytest

from stepforge.testing.distributed import run_distributed

pytestmark = pytest.mark.distributed


def _train_auto(rank: int, world_size: int, root: str, budget: dict) -> dict[str, object]:
    from _runs import example_config
    from mmengine.runner import FlexibleRunner

    cfg = example_config(
        work_dir=os.path.join(root, "auto"),
        experiment_name="auto",
        strategy=dict(type="StepforgeStrategy", plugin="auto", memory_budget=budget),
        train_cfg=dict(by_epoch=False, max_iters=4),
        default_hooks=dict(logger=dict(type="LoggerHook", interval=1)),
    )
    runner = FlexibleRunner.from_cfg(cfg)
    try:
        runner.train()
    except Exception as exc:  # reported to the test: the error is the behaviour under test
        return {"error": f"{type(exc).__name__}: {exc}"}
    losses = runner.message_hub.get_scalar("train/loss").data[0]
    with open(runner.logger.log_file) as f:
        log = f.read()
    return {
        "plugin": runner.strategy.strategy.plugin_name,
        "iters": runner.iter,
        "finite": bool((abs(losses) < 1e6).all()),
        "logged": "plugin='auto' chose" in log,
    }


def test_auto_plugin_from_an_mmengine_config(tmp_path):
    """Ample budget: both ranks train 4 iterations with the same chosen plugin (a real one, not ``auto``) and the
    log records the choice."""
    results = run_distributed(_train_auto, 2, str(tmp_path), dict(device="2GiB", host="2GiB"), timeout=240.0)
    assert {r["plugin"] for r in results} == {results[0]["plugin"]}
    assert results[0]["plugin"] in ("torch_ddp", "zero1", "zero2", "torch_fsdp")
    assert all(r["iters"] == 4 and r["finite"] for r in results)
    assert results[0]["logged"]


def test_auto_plugin_that_cannot_fit_stops_at_prepare(tmp_path):
    """A 1 KB budget: ``MemoryBudgetError`` at prepare on every rank, before training, naming the budget."""
    results = run_distributed(_train_auto, 2, str(tmp_path), dict(device=1000, host=1000), timeout=240.0)
    for r in results:
        assert r["error"].startswith("MemoryBudgetError: plugin='auto': no plugin fits the memory budget")
