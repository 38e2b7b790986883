# SPDX-License-Identifier: Apache-2.0
"""ColossalAI's master-weight members of ``LowLevelZeroOptimizer`` at 2 gloo ranks, bf16 working parameters
(fp32 masters, each rank holds half of every parameter): ``update_master_params(model)`` after loading new
weights into the model (what ``Booster.load_model`` must do, or the next step writes the old weights back), the
``working_to_master_param``/``master_to_working_param`` mappings and ``get_param_grad``.

Model: ``Linear(8, 5)``; rank ``r`` feeds two rows of ``r + 1``: the averaged gradient of every weight
element is ``2 * mean(1, 2) = 3`` and of every bias element 2 (loss = sum of the outputs).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from stepforge.testing.distributed import requires_gloo, run_distributed
from stepforge.zero.low_level import LowLevelZeroOptimizer

pytestmark = [pytest.mark.distributed, requires_gloo]


def _model() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(8, 5).to(torch.bfloat16)


def _new_weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {
        "weight": torch.randn(5, 8, generator=gen).to(torch.bfloat16),
        "bias": torch.randn(5, generator=gen).to(torch.bfloat16),
    }


def _zero_lr_step(model: nn.Linear, opt: LowLevelZeroOptimizer, rank: int) -> None:
    opt.zero_grad()
    model(torch.full((2, 8), float(rank + 1), dtype=torch.bfloat16)).sum().backward()
    opt.step()


def _masters(rank: int, world: int) -> dict:
    out: dict = {}
    model = _model()
    opt = LowLevelZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), stage=2)
    old = {k: v.clone() for k, v in model.state_dict().items()}
    new = _new_weights()
    # the defect: loaded weights alone are overwritten by the stale masters at the next step
    model.load_state_dict(new)
    _zero_lr_step(model, opt, rank)
    out["without"] = all(torch.equal(model.state_dict()[k], old[k]) for k in old)
    # the fix: refresh this rank's master pieces from the loaded working parameters
    model.load_state_dict(new)
    opt.update_master_params(model)
    _zero_lr_step(model, opt, rank)
    out["with"] = all(torch.equal(model.state_dict()[k], new[k]) for k in new)
    # the mappings: this rank's half of each parameter, both ways
    w2m, m2w = opt.working_to_master_param, opt.master_to_working_param
    master = w2m[id(model.weight)]
    out["master"] = (master.dtype, master.numel(), m2w[id(master)] is model.weight)
    out["master_values"] = torch.equal(master, new["weight"].float().reshape(-1)[rank * 20 : rank * 20 + 20])
    # ColossalAI's checkpoint-IO test reads the pieces through the padding: bias 5 over 2 ranks pads 1
    out["padding"] = (opt.get_param_padding_size(model.weight), opt.get_param_padding_size(model.bias))
    out["bias piece"] = opt.get_working_to_master_map()[id(model.bias)].tolist()
    # get_param_grad: the full averaged gradient in the parameter's shape and dtype
    opt.zero_grad()
    assert opt.get_param_grad(model.weight) is None
    model(torch.full((2, 8), float(rank + 1), dtype=torch.bfloat16)).sum().backward()
    out["grad_w"] = opt.get_param_grad(model.weight)
    out["grad_b"] = opt.get_param_grad(model.bias)
    with pytest.raises(KeyError, match="working_param"):
        opt.get_param_grad(nn.Parameter(torch.zeros(2)))
    return out


def test_master_members_at_two_ranks() -> None:
    for rank, out in enumerate(run_distributed(_masters, 2, timeout=120)):
        assert out["without"], f"rank {rank}: the stale masters should have been written back"
        assert out["with"], f"rank {rank}: update_master_params did not keep the loaded weights"
        assert out["master"] == (torch.float32, 20, True)
        assert out["master_values"]
        assert out["padding"] == (0, 1)
        bias = (
            _new_weights()["bias"].float().tolist()
        )  # rank 0: elements 0-2, rank 1: 3-4 (its padding dropped)
        assert out["bias piece"] == (bias[:3] if rank == 0 else bias[3:])
        assert torch.equal(out["grad_w"], torch.full((5, 8), 3.0, dtype=torch.bfloat16))
        assert torch.equal(out["grad_b"], torch.full((5,), 2.0, dtype=torch.bfloat16))


def test_update_master_params_without_model_refreshes_every_parameter() -> None:
    model = _model()
    opt = LowLevelZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.0))
    new = _new_weights()
    model.load_state_dict(new)
    opt.update_master_params()
    _zero_lr_step(model, opt, 0)
    assert torch.equal(model.weight, new["weight"]) and torch.equal(model.bias, new["bias"])


def test_get_grad_norm_is_the_norm_of_the_last_clipping() -> None:
    model = _model()  # bf16: the norm is taken over the fp32 gradient pieces
    opt = LowLevelZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), max_norm=1e6)
    assert opt.get_grad_norm() is None  # nothing computed yet
    _zero_lr_step(model, opt, 0)
    # every weight gradient is 2 (two rows of ones, 40 elements), every bias gradient 2 (5): sqrt(45 * 4)
    assert opt.get_grad_norm() == pytest.approx(180**0.5, rel=1e-6)
    unclipped = LowLevelZeroOptimizer(torch.optim.SGD(_model().parameters(), lr=0.0))
    assert unclipped.get_grad_norm() is None
