# SPDX-License-Identifier: Apache-2.0
"""ColossalAI's ``communication_dtype``, ``fp8_communication`` (2 gloo ranks) and ``extra_dp_group`` /
``extra_dp_size`` (4 gloo ranks) on ``LowLevelZeroOptimizer`` and ``LowLevelZeroPlugin``: the wire (:class:`stepforge.zero.comm.grad_reducer.WireFormat`) and
the 2-D grid's group (:mod:`stepforge.zero.comm.grid`).

Model: one weight of 4 elements, loss ``(w * x).sum()``, so each rank's gradient is its ``x``; the averaged
gradient is read with ``get_param_grad`` (fp32). The values are chosen so that the wire is visible and the
expected result is exact by hand:

- ``communication_dtype=bfloat16``: rank 0 sends ``x = 1 + 2**-12``, rank 1 ``x = 1``; the halves summed in
  fp32 give ``1 + 2**-13``, in bf16 (8 significant bits) ``bf16(0.5 + 2**-13) + 0.5 = 1.0``.
- fp8 (e4m3, scale ``448 / amax``): rank 0 sends ``x = [2, 1, 0.5, 0.3]``, halved ``[1, .5, .25, .15]``,
  scaled ``[448, 224, 112, 67.2]``; 67.2 rounds to 64 in e4m3 (neighbours 64 and 72), decoded ``64 / 448``.
  Rank 1 sends zeros. Sum: ``[1, .5, .25, 64/448]`` (fp32 wire: ``.15``).
- 2-D grid: rank ``r`` sends ``x = r + 1``; over the whole 4-rank grid the mean is 2.5; over a grid of the
  pairs {0, 1} and {2, 3} it is 1.5 and 3.5.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from stepforge.core import HyperParameterError
from stepforge.testing.distributed import requires_gloo, run_distributed
from stepforge.zero import LowLevelZeroOptimizer, LowLevelZeroPlugin

pytestmark = [pytest.mark.distributed, requires_gloo]


def _weight() -> nn.Parameter:
    return nn.Parameter(torch.ones(4))


def _averaged_grad(x: torch.Tensor, **kwargs) -> torch.Tensor:
    w = _weight()
    opt = LowLevelZeroOptimizer(torch.optim.SGD([w], lr=0.0), **kwargs)
    (w * x).sum().backward()
    grad = opt.get_param_grad(w)
    opt.close()
    return grad


def _two_ranks(rank: int, world: int) -> dict:
    out = {}
    x = torch.full((4,), 1.0 + 2**-12) if rank == 0 else torch.ones(4)
    for stage in (1, 2):
        out[f"fp32 stage {stage}"] = _averaged_grad(x, stage=stage)
        out[f"bf16 stage {stage}"] = _averaged_grad(x, stage=stage, communication_dtype=torch.bfloat16)
    x8 = torch.tensor([2.0, 1.0, 0.5, 0.3]) if rank == 0 else torch.zeros(4)
    for stage in (1, 2):
        for overlap in (False, True):
            out[f"fp8 stage {stage} overlap {overlap}"] = _averaged_grad(
                x8, stage=stage, fp8_communication=True, overlap_communication=overlap
            )
    out["zero_1_2"] = _zero_1_2(rank)
    # an overflow still reaches the loss scaler through the fp8 wire (e4m3fn has no inf: it becomes NaN)
    w = nn.Parameter(torch.ones(4, dtype=torch.float16))
    opt = LowLevelZeroOptimizer(torch.optim.SGD([w], lr=1.0), fp8_communication=True, partition_grad=True)
    opt.backward((w * (torch.full((4,), float("inf") if rank == 0 else 1.0, dtype=torch.float16))).sum())
    opt.step()
    out["fp8 overflow skipped"] = opt.last_step_skipped and torch.equal(w.detach(), torch.ones(4).half())
    return out


def _zero_1_2(rank: int) -> dict:
    """ColossalAI's ``exam_zero_1_2``: ZeRO-1 and ZeRO-2 (Adam lr 1, overlap, initial scale 128) on one MLP and
    one batch per rank give the same gradients (``get_param_grad``) and the same updated parameters; with the
    fp8 wire they stay within fp8's precision of the fp32-wire gradients."""
    torch.manual_seed(2001)
    base = nn.Sequential(nn.Linear(123, 64), nn.ReLU(), nn.Linear(64, 32))
    x = torch.randn(32, 123, generator=torch.Generator().manual_seed(2001 + rank))
    grads, params = {}, {}
    for fp8 in (False, True):
        for stage in (1, 2):
            model = copy.deepcopy(base)
            opt = LowLevelZeroOptimizer(
                torch.optim.Adam(model.parameters(), lr=1), overlap_communication=True, partition_grad=stage == 2,
                initial_scale=128, fp8_communication=fp8,
            )  # fmt: skip
            opt.backward(model(x).mean())
            grads[fp8, stage] = [opt.get_param_grad(p) for p in model.parameters()]
            opt.step()
            params[fp8, stage] = [p.detach().clone() for p in model.parameters()]
            opt.close()
    exact = [torch.allclose(a, b) for a, b in zip(grads[False, 1], grads[False, 2], strict=True)]
    exact += [torch.allclose(a, b) for a, b in zip(params[False, 1], params[False, 2], strict=True)]
    # fp8: both stages decode the same bytes with the same scales and sum them in the same order
    same8 = [torch.equal(a, b) for a, b in zip(grads[True, 1], grads[True, 2], strict=True)]
    # e4m3 rounds to 3 mantissa bits: each rank's halved gradient is off by at most 1/16 of its own largest
    # element (one bucket holds the whole model), so the sum by at most the ranks' largest halves over 16
    plain = copy.deepcopy(base)
    plain(x).mean().backward()
    amax = torch.stack([p.grad.abs().max() for p in plain.parameters()]).max().reshape(1) / 2
    dist.all_reduce(amax)
    near = [
        bool(((a - b).abs() <= amax / 16).all()) for a, b in zip(grads[True, 1], grads[False, 1], strict=True)
    ]
    differs = any(not torch.equal(a, b) for a, b in zip(grads[True, 1], grads[False, 1], strict=True))
    return {"exact": all(exact), "same8": all(same8), "near": all(near), "fp8 differs": differs}


def test_communication_dtype_and_fp8_wire_at_two_ranks():
    eighth = 64 / 448
    fp8 = torch.tensor([1.0, 0.5, 0.25, eighth])
    for out in run_distributed(_two_ranks, 2, timeout=120):
        for stage in (1, 2):
            assert torch.equal(out[f"fp32 stage {stage}"], torch.full((4,), 1.0 + 2**-13))
            assert torch.equal(out[f"bf16 stage {stage}"], torch.ones(4))
            for overlap in (False, True):
                assert torch.equal(out[f"fp8 stage {stage} overlap {overlap}"], fp8), (stage, overlap)
        assert out["fp8 overflow skipped"]
        assert out["zero_1_2"] == {"exact": True, "same8": True, "near": True, "fp8 differs": True}


def _grid(rank: int, world: int) -> dict:
    out = {}
    x = torch.full((4,), float(rank + 1))
    # ColossalAI's plugin grid: extra axis {r, r + 2}, inner axis {0, 1} / {2, 3} -> the whole world
    plugin = LowLevelZeroPlugin(stage=2, precision="fp32", extra_dp_size=2)
    w = _weight()
    _, opt = plugin.prepare(nn.ParameterList([w]), torch.optim.SGD([w], lr=0.0))
    (w * x).sum().backward()
    out["plugin"] = (opt.get_param_grad(w), opt.world_size, opt.working_to_master_param[id(w)].numel())
    opt.close()
    # a grid that is not the whole world: extra axis of one rank each, inner pairs {0, 1} and {2, 3}
    singles = [dist.new_group([r]) for r in range(world)]
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    grad = _averaged_grad(
        x, partition_grad=True, extra_dp_group=singles[rank], dp_process_group=pairs[rank // 2]
    )
    out["pairs"] = grad
    out["ckpt"] = _torch_ddp_ckpt(rank, world)
    # two groups that do not span a grid: refused on every rank, naming the arguments
    try:
        _averaged_grad(x, extra_dp_group=pairs[rank // 2], dp_process_group=pairs[rank // 2])
        out["bad grid"] = "no error"
    except HyperParameterError as exc:
        out["bad grid"] = str(exc)
    return out


def _torch_ddp_ckpt(rank: int, world: int) -> list[bool]:
    """ColossalAI's ``test_zero_ckpt.py`` with ``extra_dp_size=2``: after one Adam step (lr 1) the ZeRO state
    dict read in torch's key order -- ``zip(torch_state.values(), zero_state.values())`` -- matches torch's Adam
    over the mean of every rank's loss, before and after loading torch's state dict into the ZeRO optimizer."""
    extra = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    inner = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    torch.manual_seed(1453)
    reference = nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 5))
    model = copy.deepcopy(reference)
    zero = LowLevelZeroOptimizer(
        torch.optim.Adam(model.parameters(), lr=1), overlap_communication=True, initial_scale=1,
        reduce_bucket_size=262144, dp_process_group=inner, extra_dp_group=extra,
    )  # fmt: skip
    inputs = [torch.rand(4, 12, generator=torch.Generator().manual_seed(1453 + r)) for r in range(world)]
    zero.backward(model(inputs[rank]).mean())
    zero.step()
    adam = torch.optim.Adam(reference.parameters(), lr=1)
    torch.stack([reference(x).mean() for x in inputs]).mean().backward()
    adam.step()
    torch_sd = adam.state_dict()

    def matches(zero_sd: dict) -> bool:
        pairs = zip(torch_sd["state"].values(), zero_sd["state"].values(), strict=True)
        return all(
            torch.allclose(torch.as_tensor(t).float(), torch.as_tensor(z).float(), rtol=1e-5, atol=1e-6)
            for t_state, z_state in pairs
            for t, z in zip(t_state.values(), z_state.values(), strict=True)
        )

    before = matches(zero.state_dict())
    zero.load_state_dict(copy.deepcopy(torch_sd))
    return [before, matches(zero.state_dict())]


def test_extra_dp_group_shards_over_the_2d_grid_at_four_ranks():
    for rank, out in enumerate(run_distributed(_grid, 4, timeout=180)):
        grad, world, piece = out["plugin"]
        assert torch.equal(grad, torch.full((4,), 2.5)) and (world, piece) == (4, 1)
        assert torch.equal(out["pairs"], torch.full((4,), 1.5 if rank < 2 else 3.5))
        assert out["ckpt"] == [True, True]
        assert "extra_dp_group" in out["bad grid"] and "must span a 2-D grid" in out["bad grid"]
