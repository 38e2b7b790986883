# SPDX-License-Identifier: Apache-2.0
"""Lamb and Lars on DTensor parameters sharded over 2 gloo ranks equal the same optimizer on full tensors.

The parameters are split by ``distribute_tensor(..., [Shard(0)])`` (FSDP2's layout); the gradients are the
full gradients sharded the same way. Per-parameter norms (trust ratios) and Lamb's global gradient norm must
be reduced over the mesh; without that reduction the ratios are computed on half tensors and the results
differ by far more than the tolerance (rtol 1e-5, atol 1e-6 after 3 steps: only summation order differs).
"""

from __future__ import annotations

import torch

from stepforge.optim import Lamb, Lars
from stepforge.testing.distributed import requires_gloo, run_distributed

SHAPES = [(6, 4), (5,), (3, 3, 2)]  # 5 rows over 2 ranks: uneven shards
CASES = {
    "lamb": (Lamb, dict(lr=1e-2, weight_decay=0.01, max_grad_norm=0.5)),
    "lamb-foreach-off": (Lamb, dict(lr=1e-2, weight_decay=0.01, foreach=False)),
    "lars": (Lars, dict(lr=0.1, momentum=0.9, weight_decay=1e-3)),
}


def _data(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _initial() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(123)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _run(cls, kwargs, dtensor: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,)) if dtensor else None
    init = _initial()
    params = [
        torch.nn.Parameter(distribute_tensor(t.clone(), mesh, [Shard(0)]) if dtensor else t.clone())
        for t in init
    ]
    opt = cls(params, **kwargs)
    for step in range(3):
        for p, g in zip(params, _data(step), strict=True):
            p.grad = distribute_tensor(g, mesh, [Shard(0)]) if dtensor else g
        opt.step()
    return [p.full_tensor() if dtensor else p.detach() for p in params]


def _sharded(rank: int, world: int) -> dict:
    return {name: _run(cls, kw, dtensor=True) for name, (cls, kw) in CASES.items()}


@requires_gloo
def test_lamb_and_lars_on_dtensor_params_equal_full_tensors():
    sharded = run_distributed(_sharded, 2, timeout=120)[0]
    for name, (cls, kwargs) in CASES.items():
        full = _run(cls, kwargs, dtensor=False)
        for a, b in zip(sharded[name], full, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
