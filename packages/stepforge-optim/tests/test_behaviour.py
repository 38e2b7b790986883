# SPDX-License-Identifier: Apache-2.0
"""torch.optim.Optimizer behaviour of Lamb and Lars: closures, state_dict, zero_grad, sparse/absent grads, syncs."""

from __future__ import annotations

import copy
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

from stepforge.core import OPTIMIZERS, HyperParameterError, build_optimizer
from stepforge.optim import Lamb, Lars
from stepforge.testing.loops import random_grads, step_with_random_grads, trajectory_params

OPTIMIZERS_UNDER_TEST = [
    pytest.param(lambda ps, **kw: Lamb(ps, lr=1e-2, weight_decay=0.01, **kw), id="Lamb"),
    pytest.param(lambda ps, **kw: Lamb.fused_lamb(ps, lr=1e-2, **kw), id="Lamb.fused_lamb"),
    pytest.param(lambda ps, **kw: Lars(ps, lr=0.1, momentum=0.9, weight_decay=1e-3, **kw), id="Lars"),
]
SHAPES = [(6, 4), (4,), (3, 2, 2)]


@pytest.mark.parametrize("factory", OPTIMIZERS_UNDER_TEST)
def test_closure_is_called_with_grad_enabled_and_its_loss_returned(factory):
    w = torch.ones(3, requires_grad=True)
    opt = factory([w])
    calls = []

    def closure():
        calls.append(torch.is_grad_enabled())
        opt.zero_grad()
        loss = (w * w).sum()
        loss.backward()
        return loss

    before = w.detach().clone()
    loss = opt.step(closure)
    assert calls == [True] and loss.item() == pytest.approx(3.0)
    assert not torch.equal(w.detach(), before)


@pytest.mark.parametrize("factory", OPTIMIZERS_UNDER_TEST)
@pytest.mark.parametrize("maximize", [False, True])
def test_gradients_are_never_modified(factory, maximize):
    params = trajectory_params(SHAPES, torch.float32, 0)
    opt = factory(params, maximize=maximize)
    for k in range(3):
        random_grads(params, k)
        saved = [p.grad.clone() for p in params]
        opt.step()
        for p, g in zip(params, saved, strict=True):
            assert torch.equal(p.grad, g)


@pytest.mark.parametrize("factory", OPTIMIZERS_UNDER_TEST)
def test_parameters_without_grad_are_skipped(factory):
    params = trajectory_params(SHAPES, torch.float32, 0)
    frozen = params[1].detach().clone()
    opt = factory(params)
    random_grads(params, 0)
    params[1].grad = None
    opt.step()
    assert torch.equal(params[1].detach(), frozen)
    assert params[1] not in opt.state or not opt.state[params[1]]


@pytest.mark.parametrize("factory", OPTIMIZERS_UNDER_TEST)
def test_sparse_gradients_are_rejected_with_a_clear_error(factory):
    emb = torch.nn.Embedding(5, 3, sparse=True)
    opt = factory(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(HyperParameterError, match="sparse gradient.*SparseAdam"):
        opt.step()


@pytest.mark.parametrize("factory", OPTIMIZERS_UNDER_TEST)
@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad(factory, set_to_none):
    params = trajectory_params(SHAPES, torch.float32, 0)
    opt = factory(params)
    random_grads(params, 0)
    opt.zero_grad(set_to_none=set_to_none)
    for p in params:
        if set_to_none:
            assert p.grad is None
        else:
            assert p.grad is not None and not p.grad.any()


@pytest.mark.parametrize("factory", OPTIMIZERS_UNDER_TEST)
def test_state_dict_round_trip_resumes_exactly(factory):
    params = trajectory_params(SHAPES, torch.float32, 0)
    opt = factory(params)
    step_with_random_grads(opt, params, 3)
    saved_params = [p.detach().clone() for p in params]
    saved_state = copy.deepcopy(opt.state_dict())  # state_dict() shares tensors with the live state
    step_with_random_grads(opt, params, 4, seed=200)
    expected = [p.detach().clone() for p in params]

    resumed = [p.clone().detach().requires_grad_() for p in saved_params]
    opt2 = factory(resumed)
    opt2.load_state_dict(saved_state)
    step_with_random_grads(opt2, resumed, 4, seed=200)
    for a, b in zip(resumed, expected, strict=True):
        assert torch.equal(a.detach(), b)


_CHILD = textwrap.dedent(
    """
    import copy, sys, torch
    from stepforge.optim import Lamb, Lars
    kind, path = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    params = [torch.randn(6, 4, dtype=torch.bfloat16).requires_grad_(), torch.randn(4).requires_grad_()]
    opt = (Lamb(params, lr=1e-2, weight_decay=0.01, bias_correction=True) if kind == "Lamb"
           else Lars(params, lr=0.1, momentum=0.9, weight_decay=1e-3))

    def train(steps):
        for k in steps:
            gen = torch.Generator().manual_seed(k)
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
            opt.step()

    train(range(3))
    ckpt = {"params": [p.detach().clone() for p in params], "optimizer": copy.deepcopy(opt.state_dict())}
    train(range(3, 6))
    ckpt["final"] = [p.detach().clone() for p in params]
    torch.save(ckpt, path)
    """
)


@pytest.mark.parametrize("kind", ["Lamb", "Lars"])
def test_state_dict_loads_in_a_fresh_process(kind, tmp_path: pathlib.Path):
    """Save after 3 steps in a child process; resume here; 3 more steps equal the child's uninterrupted run."""
    path = tmp_path / "ckpt.pt"
    env = {**os.environ, "PYTHONWARNINGS": "error"}
    subprocess.run([sys.executable, "-c", _CHILD, kind, str(path)], check=True, env=env, timeout=120)
    ckpt = torch.load(path, weights_only=True)
    params = [p.clone().requires_grad_() for p in ckpt["params"]]
    if kind == "Lamb":
        opt = Lamb(params, lr=1e-2, weight_decay=0.01, bias_correction=True)
    else:
        opt = Lars(params, lr=0.1, momentum=0.9, weight_decay=1e-3)
    opt.load_state_dict(ckpt["optimizer"])
    for state in opt.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                assert value.dtype == torch.float32, f"{key} must stay fp32 after load_state_dict"
            else:
                assert key == "step" and value == 3
    for k in range(3, 6):
        gen = torch.Generator().manual_seed(k)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.step()
    for p, final in zip(params, ckpt["final"], strict=True):
        assert torch.equal(p.detach(), final)


def test_load_state_dict_keeps_fp32_state_for_bf16_params_and_converts_tensor_steps():
    params = trajectory_params(SHAPES, torch.bfloat16, 0)
    opt = Lamb(params, lr=1e-2, weight_decay=0.01)
    step_with_random_grads(opt, params, 2)
    sd = opt.state_dict()
    # A torch.optim / ColossalAI-style state dict: tensor step, extra per-param keys.
    for state in sd["state"].values():
        state["step"] = torch.tensor(float(state["step"]))
        state["trust_ratio"] = torch.tensor(0.5)
    opt2 = Lamb(trajectory_params(SHAPES, torch.bfloat16, 0), lr=1e-2, weight_decay=0.01)
    opt2.load_state_dict(sd)
    for state in opt2.state.values():
        assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
        assert state["step"] == 2 and isinstance(state["step"], int)
        assert state["exp_avg"].dtype == torch.float32 and state["exp_avg_sq"].dtype == torch.float32
    for a, b in zip(opt.state.values(), opt2.state.values(), strict=True):
        assert torch.equal(a["exp_avg"], b["exp_avg"])  # bit-exact: no round trip through bf16


@pytest.mark.parametrize("factory", OPTIMIZERS_UNDER_TEST)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_state_dtype_follows_the_documented_policy(factory, dtype):
    params = trajectory_params(SHAPES, dtype, 0)
    opt = factory(params)
    step_with_random_grads(opt, params, 2)
    want = torch.float64 if dtype == torch.float64 else torch.float32
    for p in params:
        assert p.dtype == dtype
        for value in opt.state[p].values():
            if isinstance(value, torch.Tensor):
                assert value.dtype == want


@pytest.mark.parametrize("factory", OPTIMIZERS_UNDER_TEST)
@pytest.mark.parametrize("chunk_size", [None, 5])
def test_no_host_synchronisation_during_step(factory, chunk_size, monkeypatch):
    """No ``.item()``, ``bool(tensor)``, ``float(tensor)`` or ``.tolist()`` inside ``step`` (also when split)."""
    params = trajectory_params(SHAPES, torch.float32, 0)
    opt = factory(params, chunk_size=chunk_size)
    random_grads(params, 0)
    opt.step()  # state creation is allowed to do anything

    def forbidden(*args, **kwargs):
        raise AssertionError("host synchronisation inside step()")

    for name in ("item", "__bool__", "__float__", "__int__", "tolist", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    random_grads(params, 1)
    opt.step()


@pytest.mark.parametrize("factory", OPTIMIZERS_UNDER_TEST)
def test_foreach_false_and_chunking_give_the_same_result(factory):
    results = []
    for kw in ({}, {"foreach": False}, {"chunk_size": 7}, {"foreach": True, "chunk_size": 10**6}):
        params = trajectory_params(SHAPES, torch.float64, 0)
        step_with_random_grads(factory(params, **kw), params, 5)
        results.append([p.detach() for p in params])
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("factory", OPTIMIZERS_UNDER_TEST)
def test_non_contiguous_parameters_are_updated_in_place(factory):
    base = trajectory_params([(5, 7)], torch.float64, 0)[0]
    t = base.detach().t().requires_grad_()  # a transposed, non-contiguous leaf
    contiguous = t.detach().contiguous().requires_grad_()
    for p in (t, contiguous):
        opt = factory([p])
        gen = torch.Generator().manual_seed(3)
        for _ in range(3):
            p.grad = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            opt.step()
    assert not t.is_contiguous()
    torch.testing.assert_close(t.detach(), contiguous.detach(), rtol=1e-12, atol=1e-14)


def test_registered_in_the_optimizer_registry():
    model = torch.nn.Linear(4, 2)
    assert isinstance(build_optimizer(dict(type="Lamb", lr=1e-3, weight_decay=0.01), model), Lamb)
    assert isinstance(build_optimizer(dict(type="lars", lr=0.1, momentum=0.9), model.parameters()), Lars)
    assert OPTIMIZERS.get("Lamb") is Lamb and OPTIMIZERS.get("Lars") is Lars


def test_lamb_adam_switch_and_zero_weight_decay_without_adaptation_is_adam_like():
    """``adam=True`` and (wd=0, always_adapt=False) both give ratio 1: the same as each other."""
    out = []
    for kw in ({"adam": True}, {"always_adapt": False}):
        params = trajectory_params(SHAPES, torch.float64, 0)
        step_with_random_grads(Lamb(params, lr=1e-2, **kw), params, 4)
        out.append(params)
    for a, b in zip(*out, strict=True):
        torch.testing.assert_close(a.detach(), b.detach())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_matches_cpu(dtype):
    for cls, kw in (
        (Lamb, dict(lr=1e-2, weight_decay=0.01, max_grad_norm=1.0)),
        (Lars, dict(lr=0.1, momentum=0.9)),
    ):
        cpu = trajectory_params(SHAPES, dtype, 0)
        cuda = [p.detach().cuda().requires_grad_() for p in cpu]
        opt_cpu, opt_cuda = cls(cpu, **kw), cls(cuda, **kw)
        for k in range(5):
            random_grads(cpu, k)
            for p, q in zip(cpu, cuda, strict=True):
                q.grad = p.grad.cuda()
            opt_cpu.step()
            opt_cuda.step()
        for p, q in zip(cpu, cuda, strict=True):
            torch.testing.assert_close(q.detach().cpu().float(), p.detach().float(), rtol=1e-2, atol=1e-3)
