# SPDX-License-Identifier: Apache-2.0
"""The FSDP2 plugins' model ``state_dict()`` is what ColossalAI's FSDP1 / Gemini models gave: the full, unsharded
state as plain tensors, a snapshot that later steps leave alone (ColossalAI's FSDP checkpoint test takes
``state_dict()``, trains a step and expects the old dict to differ from the new one). ``torch_fsdp``: on every
rank; ``gemini``: on rank 0, ``{}`` elsewhere. The sharded form is torch's ``get_model_state_dict``, and DCP
checkpoints (which read it) still hold this rank's shards.

Reference: the same model and steps in plain torch on one process over the concatenated batch (SGD, fp32;
rtol 1e-5, atol 1e-6: only the reduction order differs). 2 gloo ranks, one spawn for every case.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stepforge.strategy import Booster
from stepforge.testing.distributed import requires_gloo, run_distributed
from stepforge.testing.models import block_net, regression_batch

ROWS, WIDTH = 4, 6


def _net() -> nn.Module:
    """Two blocks (each an FSDP2 unit) and a head; the first block counts its calls in a buffer updated in place
    (FSDP2 keeps buffers whole on every rank: a state dict must copy them, not hold them)."""
    net = block_net(0, d_in=WIDTH, width=WIDTH)
    net.blocks[0].register_buffer("calls", torch.zeros(()))
    net.blocks[0].register_forward_pre_hook(_count)
    return net


def _count(block: nn.Module, args: tuple) -> None:
    block.calls.add_(1)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return regression_batch(2 * ROWS, WIDTH, 1, seed=step)


def _step(model: nn.Module, opt: torch.optim.Optimizer, step: int, rows: slice) -> None:
    x, y = _batch(step)
    F.mse_loss(model(x[rows]), y[rows]).backward()
    opt.step()
    opt.zero_grad()


def _clone(state: dict) -> dict:
    return {k: v.clone() for k, v in state.items()}


def _run(rank: int, world: int) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor

    rows = slice(rank * ROWS, (rank + 1) * ROWS)
    out: dict = {}
    booster = Booster(plugin="torch_fsdp")
    net = _net()
    model, opt, *_ = booster.boost(net, torch.optim.SGD(net.parameters(), lr=0.1))
    _step(model, opt, 0, rows)
    first = model.state_dict()  # the boosted ModelWrapper: keys prefixed "module." as in ColossalAI
    first_copy = _clone(first)
    first_unwrapped = model.unwrap().state_dict()  # the FSDP2 module itself: the original keys
    out["types"] = {type(v) for v in (*first.values(), *first_unwrapped.values())}
    out["keys"] = (sorted(first), sorted(first_unwrapped))
    _step(model, opt, 1, rows)
    second = model.state_dict()
    # the snapshot did not move with the model, and the model did move
    out["first_kept"] = all(torch.equal(first[k], first_copy[k]) for k in first)
    out["changed"] = sorted(k for k in first if not torch.equal(first[k], second[k]))
    out["second"] = {k.removeprefix("module."): v for k, v in second.items()}
    out["unwrapped_first"] = first_unwrapped
    # the sharded form, one call away, and what a DCP checkpoint reads (plugin.get_state_dict)
    sharded = get_model_state_dict(model.unwrap())
    msd, _ = booster.plugin.get_state_dict(model.unwrap(), [])
    out["sharded_rows"] = {k: v.to_local().shape[0] for k, v in sharded.items() if isinstance(v, DTensor)}
    out["dcp_all_dtensor_params"] = all(
        isinstance(msd[n], DTensor) for n, _ in model.unwrap().named_parameters()
    )
    out["explicit"] = {k: v.clone() for k, v in model.state_dict(only_rank_0=False).items()}

    gemini = Booster(plugin=dict(type="gemini", precision="fp32", placement_policy="static"))
    net = _net()
    gmodel, gopt, *_ = gemini.boost(net, torch.optim.SGD(net.parameters(), lr=0.1))
    _step(gmodel, gopt, 0, rows)
    out["gemini"] = gmodel.unwrap().state_dict()
    out["gemini_everywhere"] = gmodel.unwrap().state_dict(only_rank_0=False)
    return out


def _reference(steps: int) -> dict:
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(steps):
        _step(net, opt, step, slice(None))
    return net.state_dict()


@requires_gloo
def test_fsdp_state_dict_is_a_full_snapshot_and_dcp_still_reads_shards():
    results = run_distributed(_run, 2, timeout=240)
    after_one, after_two = _reference(1), _reference(2)
    names = sorted(after_one)
    for rank, out in enumerate(results):
        assert out["types"] == {torch.Tensor}, rank  # plain tensors, no DTensor
        assert out["keys"] == (sorted(f"module.{k}" for k in names), names), rank
        assert out["first_kept"], rank
        # every parameter and the buffer moved with the second step; the snapshot kept the first
        assert out["changed"] == sorted(f"module.{k}" for k in names), rank
        for key in names:
            torch.testing.assert_close(out["unwrapped_first"][key], after_one[key], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(out["second"][key], after_two[key], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(out["explicit"][key], after_two[key], rtol=1e-5, atol=1e-6)
        # this rank's shards: half the rows of every sharded parameter of 6 rows
        assert out["sharded_rows"]["blocks.0.weight"] == WIDTH // 2 and out["dcp_all_dtensor_params"], rank
        for key in names:
            torch.testing.assert_close(out["gemini_everywhere"][key], after_one[key], rtol=1e-5, atol=1e-6)
    assert sorted(results[0]["gemini"]) == names and results[1]["gemini"] == {}
    for key in names:
        torch.testing.assert_close(results[0]["gemini"][key], after_one[key], rtol=1e-5, atol=1e-6)
