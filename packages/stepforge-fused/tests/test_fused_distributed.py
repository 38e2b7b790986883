# SPDX-License-Identifier: Apache-2.0
"""DTensor parameters (``_distributed.py``): FSDP2 ``fully_shard`` on a 2-rank gloo CPU mesh.

Reference: the same optimizer on plain tensors in one process, fed the very same gradients (the FSDP2 run's
gradient DTensors gathered with ``full_tensor()``); Adam and SGD are elementwise, so stepping the local shards
must give the unsharded result bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from stepforge.testing.distributed import requires_gloo, run_distributed

pytestmark = requires_gloo


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _sharded(seed: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2,))
    model = _model(seed)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _run_against_reference(rank, make_opt, steps=3):
    from torch.distributed.tensor import DTensor

    model = _sharded(0)
    ref = _model(0)
    opt = make_opt(model.parameters())
    ref_opt = make_opt(ref.parameters())
    gen = torch.Generator().manual_seed(123)
    for _ in range(steps):
        x = torch.randn(8, 16, generator=gen)
        opt.zero_grad()
        model(x[rank * 4 : rank * 4 + 4]).pow(2).mean().backward()
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            assert isinstance(p, DTensor) and isinstance(p.grad, DTensor)
            q.grad = p.grad.full_tensor().clone()
        opt.step()
        ref_opt.step()
    out = []
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        out.append(bool(torch.equal(p.full_tensor(), q.detach())))
    return opt, ref_opt, model, out


def _all_checks(rank: int, world_size: int) -> dict:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from torch.distributed.tensor import DTensor

    from stepforge.fused import FusedAdam, FusedLAMB, FusedSGD

    res: dict = {}
    # 1. FusedAdam: bit-identical to the unsharded run; state is DTensor with the param's placements
    opt, ref_opt, model, same = _run_against_reference(
        rank, lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.01)
    )
    res["adam_equal"] = same
    p0 = next(iter(model.parameters()))
    st = opt.state[p0]
    res["state_dtensor"] = isinstance(st["exp_avg"], DTensor) and st["exp_avg"].placements == p0.placements
    res["state_matches"] = all(
        torch.equal(opt.state[p]["exp_avg_sq"].full_tensor(), ref_opt.state[q]["exp_avg_sq"])
        for p, q in zip(model.parameters(), ref_opt.param_groups[0]["params"], strict=True)
    )
    osd = get_optimizer_state_dict(model, opt)
    res["dcp_state_keys"] = sorted(next(iter(osd["state"].values())).keys())
    # 2. FusedSGD with momentum
    _, _, _, same = _run_against_reference(rank, lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9, nesterov=True))
    res["sgd_equal"] = same
    # 3. a non-finite grad shard on one rank only: every rank skips the step (one decision over the mesh)
    model = _sharded(1)
    opt = FusedAdam(model.parameters(), lr=1e-2, skip_nonfinite=True)
    model(torch.randn(4, 16)).sum().backward()
    if rank == 0:
        next(iter(model.parameters())).grad._local_tensor[0] = float("inf")
    before = [p.full_tensor().clone() for p in model.parameters()]
    opt.step()
    res["skipped"] = opt.last_step_skipped
    res["unchanged"] = all(
        torch.equal(p.full_tensor(), b) for p, b in zip(model.parameters(), before, strict=True)
    )
    # 4. FusedLAMB refuses sharded params (its trust ratio would come from the local shard)
    try:
        FusedLAMB(_sharded(2).parameters())
        res["lamb"] = "accepted"
    except RuntimeError as exc:
        res["lamb"] = str(exc)
    return res


def test_fused_optimizers_step_fsdp2_dtensor_params_like_the_unsharded_run():
    results = run_distributed(_all_checks, 2, timeout=240)
    for rank, res in enumerate(results):
        assert all(res["adam_equal"]), (rank, res["adam_equal"])
        assert res["state_dtensor"] and res["state_matches"], rank
        assert res["dcp_state_keys"] == ["exp_avg", "exp_avg_sq", "step"], rank
        assert all(res["sgd_equal"]), (rank, res["sgd_equal"])
        assert res["skipped"] and res["unchanged"], rank
        assert "stepforge.optim.Lamb" in res["lamb"], res["lamb"]


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__])
