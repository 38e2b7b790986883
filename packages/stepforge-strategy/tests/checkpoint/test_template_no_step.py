# SPDX-License-Identifier: Apache-2.0
"""Templates never step the optimizer, and a resume never drops the checkpoint's optimizer state.

- A save at iteration 0 (before any step) and a resume from it give, after the first real step, the optimizer
  state of an uninterrupted run bit for bit (AdamW's step count 1, not 2): ``single`` in this process,
  ``torch_fsdp`` and ``zero2`` on 2 gloo ranks. The save itself leaves the optimizer unstepped.
- A resume into a run where parameters already hold ``.grad`` restores the checkpoint's optimizer state and
  leaves the gradients as the checkpoint says (none at a window boundary, the saved ones inside a window).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from _strategy_cases import COUNTS, full_params, make_model, make_strategy, prepare, train
from torch.distributed.tensor import DTensor

from stepforge.core import unwrap_optimizer
from stepforge.strategy import Booster
from stepforge.testing.distributed import requires_gloo, run_distributed


def _inner(s: Any) -> torch.optim.Optimizer:
    return unwrap_optimizer(s.optim_wrapper.optimizer)


def _local(v: Any) -> Any:
    v = v.to_local() if isinstance(v, DTensor) else v
    return v.detach().clone() if isinstance(v, torch.Tensor) else v


def _state(s: Any) -> list[dict[str, Any]]:
    """This rank's optimizer state in parameter order (local shards)."""
    opt = _inner(s)
    return [{k: _local(v) for k, v in opt.state[p].items()} for g in opt.param_groups for p in g["params"]]


def _same_state(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(torch.equal(torch.as_tensor(x[k]), torch.as_tensor(y[k])) for k in x)
        for x, y in zip(a, b, strict=True)
    )


def _save_at_zero_then_resume(rank: int, world_size: int, work: str, plugin: Any) -> dict[str, Any]:
    ref = make_strategy(os.path.join(work, "ref"), plugin=plugin)
    prepare(ref)
    train(ref, 0, COUNTS, rank)  # one optimizer step
    first = make_strategy(os.path.join(work, "first"), plugin=plugin)
    prepare(first)
    path = first.save_checkpoint(os.path.join(work, "iter0"))
    saver_unstepped = not _inner(first).state
    train(first, 0, COUNTS, rank)  # the save changed nothing of the saver's training
    second = make_strategy(os.path.join(work, "second"), plugin=plugin)
    prepare(second, model_seed=5)
    second.resume(path)
    resumed_unstepped = not _inner(second).state
    train(second, 0, COUNTS, rank)
    return dict(
        saver_unstepped=saver_unstepped,
        resumed_unstepped=resumed_unstepped,
        saver_same=_same_state(_state(first), _state(ref)),
        resumed_same=_same_state(_state(second), _state(ref)),
        params_same=all(torch.equal(a, b) for a, b in zip(full_params(second.model).values(),
                                                          full_params(ref.model).values(), strict=True)),
        steps=sorted({float(e["step"]) for e in _state(second) if "step" in e}),
    )  # fmt: skip


def _check(result: dict[str, Any]) -> None:
    assert result["saver_unstepped"] and result["resumed_unstepped"]
    assert result["steps"] == [1.0]
    assert result["saver_same"] and result["resumed_same"] and result["params_same"]


def test_save_at_iteration_zero_single(tmp_path):
    _check(_save_at_zero_then_resume(0, 1, str(tmp_path), None))


@requires_gloo
@pytest.mark.parametrize(
    "plugin", ["torch_fsdp", dict(type="zero2", precision="fp32")], ids=["torch_fsdp", "zero2"]
)
def test_save_at_iteration_zero_two_gloo_ranks(tmp_path, plugin):
    for result in run_distributed(_save_at_zero_then_resume, 2, str(tmp_path), plugin, timeout=240):
        _check(result)


def test_resume_into_parameters_with_grads_restores_the_optimizer_state(tmp_path):
    work = str(tmp_path)
    saver = make_strategy(os.path.join(work, "saver"))
    prepare(saver)
    train(saver, 0, COUNTS, 0)
    boundary = saver.save_checkpoint(os.path.join(work, "boundary"))
    want_boundary = _state(saver)
    train(saver, COUNTS, COUNTS + 1, 0)
    mid = saver.save_checkpoint(os.path.join(work, "mid"))
    want_mid_grads = [p.grad.clone() for p in saver.model.parameters()]
    want_mid = _state(saver)

    victim = make_strategy(os.path.join(work, "victim"))
    prepare(victim, model_seed=5)
    train(victim, 0, 1, 0)  # every parameter holds a .grad, the optimizer never stepped
    assert all(p.grad is not None for p in victim.model.parameters()) and not _inner(victim).state
    victim.resume(boundary)
    assert _same_state(_state(victim), want_boundary)  # restored, not dropped
    assert all(p.grad is None for p in victim.model.parameters())  # a window boundary holds no gradients
    assert victim.optim_wrapper.window.position == 0

    train(victim, COUNTS, COUNTS + 1, 0)  # gradients again, and a stepped optimizer
    victim.resume(mid)
    assert _same_state(_state(victim), want_mid)
    got = [p.grad for p in victim.model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(got, want_mid_grads, strict=True))


def test_booster_load_optimizer_into_parameters_with_grads(tmp_path):
    booster = Booster(plugin="single")
    net = make_model(0)
    model, opt, *_ = booster.boost(net, torch.optim.AdamW(net.parameters(), lr=0.1))
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()
    booster.save_optimizer(opt, tmp_path / "optim")
    want = {k: v.clone() for k, v in unwrap_optimizer(opt).state[next(model.parameters())].items()}

    other = Booster(plugin="single")
    net2 = make_model(1)
    model2, opt2, *_ = other.boost(net2, torch.optim.AdamW(net2.parameters(), lr=0.1))
    model2(torch.randn(4, 8)).square().mean().backward()  # grads present, optimizer never stepped
    other.load_optimizer(opt2, tmp_path / "optim")
    got = unwrap_optimizer(opt2).state[next(model2.parameters())]
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
