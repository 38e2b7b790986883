# SPDX-License-Identifier: Apache-2.0
"""``ZeroRedundancyOptimizer`` used as torch's class: torch's signature (``optimizer_class=``,
positional, ``overlap_with_ddp=False``) beside mmengine's ``optimizer_type``; torch's state-dict protocol (after
``consolidate_state_dict(to=k)`` on every rank, ``state_dict()`` on rank ``k`` alone returns the full state with
no collective, ``{}`` on the others); a bare tensor as ``params`` raises ``TypeError`` as torch's does.

Model: 4 parameters, rank-independent gradients ``g_i = i + 1`` (no DDP needed: every rank sees the same),
SGD(lr=0.1, momentum=0.9): after n steps the momentum buffer is ``g_i * sum(0.9**j, j < n)``: 1.9 g_i after
two steps, 2.71 g_i after three.
"""

from __future__ import annotations

import pytest
import torch

from stepforge.core import HyperParameterError
from stepforge.testing.distributed import requires_gloo, run_distributed
from stepforge.testing.zero_cases import counting
from stepforge.zero import ZeroRedundancyOptimizer

SHAPES = [(3, 2), (5,), (2, 2), (7,)]


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(shape)) for shape in SHAPES]


def _steps(optimizer: ZeroRedundancyOptimizer, params: list[torch.nn.Parameter], n: int) -> None:
    for _ in range(n):
        for i, p in enumerate(params):
            p.grad = torch.full_like(p, float(i + 1))
        optimizer.step()


def _buffers(state: dict) -> list[torch.Tensor]:
    # copies: like torch.optim's, the state dict holds the live buffers of the parameters this rank owns
    return [state["state"][i]["momentum_buffer"].clone() for i in range(len(SHAPES))]


def _torch_protocol(rank: int, world: int) -> dict:
    out: dict = {}
    params = _params()
    # torch's spelling, keyword and positional, beside a short consolidate timeout: a collective that only
    # one rank entered would fail within 3 s instead of returning
    opt = ZeroRedundancyOptimizer(
        params,
        optimizer_class=torch.optim.SGD,
        lr=0.1,
        momentum=0.9,
        overlap_with_ddp=False,
        consolidate_timeout=3,
    )
    positional = ZeroRedundancyOptimizer(_params(), torch.optim.SGD, lr=0.1)
    out["names"] = (opt.optimizer_type, positional.optimizer_type)
    _steps(opt, params, 2)
    opt.consolidate_state_dict(to=1)
    with counting() as calls:
        state = opt.state_dict()  # rank 1 alone gets the state; rank 0 gets {} (no collective either way)
        again = opt.state_dict()  # torch serves the consolidated state until the next step
    out["calls"] = sum(v for k, v in calls.items() if not k.endswith(".elements"))
    out["state"] = _buffers(state) if state else None
    out["again"] = _buffers(again) if again else None
    # after a step the consolidated copy is stale: state_dict() is mmengine's collective call again (rank 0)
    _steps(opt, params, 1)
    later = opt.state_dict()
    out["later"] = _buffers(later) if later else None
    return out


@pytest.mark.distributed
@requires_gloo
def test_torch_state_dict_protocol_at_two_ranks() -> None:
    results = run_distributed(_torch_protocol, 2, timeout=120)
    two = [torch.full(s, 1.9 * (i + 1)) for i, s in enumerate(SHAPES)]
    three = [torch.full(s, 2.71 * (i + 1)) for i, s in enumerate(SHAPES)]
    for rank, out in enumerate(results):
        assert out["names"] == ("SGD", "SGD")
        assert out["calls"] == 0, f"rank {rank}: state_dict() after consolidation made collectives"
    assert results[0]["state"] is None and results[0]["again"] is None
    for got in (results[1]["state"], results[1]["again"]):
        assert got is not None
        for g, w in zip(got, two, strict=True):
            torch.testing.assert_close(g, w)
    assert results[1]["later"] is None
    assert results[0]["later"] is not None
    for g, w in zip(results[0]["later"], three, strict=True):
        torch.testing.assert_close(g, w)


def test_a_bare_tensor_as_params_raises_type_error() -> None:
    with pytest.raises(TypeError, match="params"):
        ZeroRedundancyOptimizer(torch.zeros(3, requires_grad=True), optimizer_class=torch.optim.SGD, lr=0.1)


def test_optimizer_type_and_optimizer_class_exclude_each_other() -> None:
    with pytest.raises(HyperParameterError, match="optimizer_class"):
        ZeroRedundancyOptimizer(_params(), "SGD", optimizer_class=torch.optim.SGD, lr=0.1)
    with pytest.raises(HyperParameterError, match="optimizer_type"):
        ZeroRedundancyOptimizer(_params(), lr=0.1)


def test_overlap_with_ddp_true_is_still_refused() -> None:
    with pytest.raises(HyperParameterError, match="overlap_with_ddp"):
        ZeroRedundancyOptimizer(_params(), optimizer_class=torch.optim.SGD, overlap_with_ddp=True, lr=0.1)
