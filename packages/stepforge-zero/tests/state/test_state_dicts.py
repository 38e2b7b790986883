# SPDX-License-Identifier: Apache-2.0
"""Checkpoints: the sharded form through DCP saved at 4 ranks and loaded at 2 and 1, and the full form.

Every resumed run must continue on the trajectory of one uninterrupted single-process run (fp32: rtol 1e-6;
bf16: the tolerance of test_low_level_parity, see there).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from stepforge.core import build_optimizer
from stepforge.testing.distributed import requires_gloo, run_distributed
from stepforge.testing.zero_cases import (
    flat_params,
    loss_fn,
    make_model,
    micro_batches,
    optimizer_cfg,
    param_groups,
    reference_run,
)
from stepforge.zero.low_level import LowLevelZeroOptimizer

pytestmark = [pytest.mark.distributed, requires_gloo]

BEFORE, AFTER = 2, 2  # steps before the checkpoint, steps after the resume
CASES = {"fp32-stage2": (torch.float32, 2), "bf16-stage1": (torch.bfloat16, 1)}


def _build(dtype: torch.dtype, stage: int) -> tuple[torch.nn.Module, LowLevelZeroOptimizer]:
    model = make_model(dtype=dtype)
    inner = build_optimizer(optimizer_cfg("AdamW"), param_groups(model))
    return model, LowLevelZeroOptimizer(inner, stage=stage, reduce_bucket_size=40)


def _train(model, opt, rank: int, world: int, dtype: torch.dtype, steps: range) -> None:
    for step in steps:
        x, y = next(micro_batches(step, 1, rank, world, dtype))
        opt.backward(loss_fn(model, x, y))
        opt.step()
        opt.zero_grad()


def _save(rank: int, world: int, root: str) -> None:
    for name, (dtype, stage) in CASES.items():
        model, opt = _build(dtype, stage)
        _train(model, opt, rank, world, dtype, range(BEFORE))
        dcp.save(
            {"model": model.state_dict(), "optim": opt.sharded_state_dict()}, checkpoint_id=f"{root}/{name}"
        )
        full = opt.state_dict()  # collective: every rank gets the full state
        if rank == 0:
            torch.save({"model": model.state_dict(), "optim": full}, f"{root}/{name}.full.pt")


def _resume(rank: int, world: int, root: str) -> dict[str, torch.Tensor]:
    out = {}
    for name, (dtype, stage) in CASES.items():
        model, opt = _build(dtype, stage)
        sd = {"model": model.state_dict(), "optim": opt.sharded_state_dict()}
        assert not opt.optim.state, "asking a fresh optimizer for a template must not step it"
        dcp.load(sd, checkpoint_id=f"{root}/{name}")
        model.load_state_dict(sd["model"])
        opt.load_sharded_state_dict(sd["optim"])
        _train(model, opt, rank, world, dtype, range(BEFORE, BEFORE + AFTER))
        out[name] = flat_params(model)
        # the full form, loaded at this world size
        model, opt = _build(dtype, stage)
        saved = torch.load(f"{root}/{name}.full.pt", weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optim"])
        _train(model, opt, rank, world, dtype, range(BEFORE, BEFORE + AFTER))
        out[name + ".full"] = flat_params(model)
    return out


def _close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7, msg=lambda m: f"{what}: {m}")
    else:
        torch.testing.assert_close(got, ref, rtol=2**-7, atol=1e-3, msg=lambda m: f"{what}: {m}")


def test_save_at_four_ranks_load_at_two_and_one(tmp_path):
    root = str(tmp_path)
    run_distributed(_save, 4, root, timeout=180)
    assert os.path.exists(f"{root}/fp32-stage2/.metadata")
    resumed = {world: run_distributed(_resume, world, root, timeout=180) for world in (2, 1)}
    for name, (dtype, _) in CASES.items():
        ref = flat_params(reference_run("AdamW", BEFORE + AFTER, dtype=dtype)[0])
        for world, results in resumed.items():
            for rank, got in enumerate(results):
                _close(got[name], ref, dtype, f"{name} DCP 4->{world} rank {rank}")
                _close(got[name + ".full"], ref, dtype, f"{name} full 4->{world} rank {rank}")
        # the full form also loads into the plain inner optimizer (fp32 working params: same trajectory)
        if dtype == torch.float32:
            saved = torch.load(f"{root}/{name}.full.pt", weights_only=False)
            model = make_model()
            model.load_state_dict(saved["model"])
            model, _ = reference_run("AdamW", AFTER, start=BEFORE, model=model, state=saved["optim"])
            _close(flat_params(model), ref, dtype, f"{name} full -> plain AdamW")
