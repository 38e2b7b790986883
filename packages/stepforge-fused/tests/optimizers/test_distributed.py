# SPDX-License-Identifier: Apache-2.0
"""DTensor parameters (``_distributed.py``): FSDP2 ``fully_shard`` on a 2-rank gloo CPU mesh.

Reference: the same optimizer on plain tensors in one process, fed the very same gradients (the FSDP2 run's
gradient DTensors gathered with ``full_tensor()``); Adam and SGD are elementwise, so stepping the local shards
must give the unsharded result bit for bit. FusedLAMB reduces each sharded parameter's ``||p||``, ``||u||`` and the
global grad norm over the mesh: only the summation order of those norms differs, so its parameters after 3 steps
must agree within rtol 1e-6, atol 1e-7 (a float32 ulp or two), clipping active or not.
"""

from __future__ import annotations

import math

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


LAMB_TOL = dict(rtol=1e-6, atol=1e-7)


def _run_against_reference(rank, make_opt, steps=3, tol=None):
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
        if tol is None:
            out.append(bool(torch.equal(p.full_tensor(), q.detach())))
        else:  # worst error in units of the tolerance (<= 1 passes)
            err = (p.full_tensor() - q.detach()).abs() / (tol["atol"] + tol["rtol"] * q.detach().abs())
            out.append(float(err.max()))
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
    # 4. FusedLAMB: trust ratios and the global grad norm over the mesh; clipping off, active, and nvlamb
    for name, kw in {
        "lamb": dict(lr=1e-2, weight_decay=0.01),
        "lamb_clip": dict(lr=5e-2, weight_decay=0.1, max_grad_norm=0.05),
        "lamb_nvlamb_l2": dict(lr=1e-2, weight_decay=0.0, use_nvlamb=True, adam_w_mode=False),
    }.items():
        res[name] = _run_against_reference(rank, lambda ps, kw=kw: FusedLAMB(ps, **kw), tol=LAMB_TOL)[3]
    # the clip is global: a rank's own grad norm alone would give another divisor (the test can tell)
    model = _sharded(3)
    opt = FusedLAMB(model.parameters(), max_grad_norm=1e-3)
    model(torch.randn(4, 16)).sum().backward()
    local = math.sqrt(sum(float(p.grad._local_tensor.double().pow(2).sum()) for p in model.parameters()))
    full = math.sqrt(sum(float(p.grad.full_tensor().double().pow(2).sum()) for p in model.parameters()))
    plans = [(g, opt._bucket_cache.group_buckets(opt, i, g)) for i, g in enumerate(opt.param_groups)]
    res["clip_divisor"] = (opt._pre_step(plans, 1.0), full / 1e-3, local / 1e-3)
    return res


def test_fused_optimizers_step_fsdp2_dtensor_params_like_the_unsharded_run():
    results = run_distributed(_all_checks, 2, timeout=240)
    for rank, res in enumerate(results):
        assert all(res["adam_equal"]), (rank, res["adam_equal"])
        assert res["state_dtensor"] and res["state_matches"], rank
        assert res["dcp_state_keys"] == ["exp_avg", "exp_avg_sq", "step"], rank
        assert all(res["sgd_equal"]), (rank, res["sgd_equal"])
        assert res["skipped"] and res["unchanged"], rank
        for name in ("lamb", "lamb_clip", "lamb_nvlamb_l2"):
            assert max(res[name]) <= 1.0, (rank, name, res[name])
        got, full, local = res["clip_divisor"]
        assert got == pytest.approx(full, rel=1e-12), (rank, res["clip_divisor"])
        assert abs(full - local) > 1e-6 * full, (rank, res["clip_divisor"])  # the probe can tell them apart


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__])
