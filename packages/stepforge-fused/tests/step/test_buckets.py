# SPDX-License-Identifier: Apache-2.0
"""The pointer cache (``_buckets.py``): every move of a parameter's or gradient's memory is seen at the next step.

Reference: ``torch.optim.AdamW(fused=True)`` / ``torch.optim.SGD`` driven through the very same sequence of
moves on a twin model; float32 results must be bit-identical (torch's fused AdamW is, see optimizers/test_adam.py).
"""

from __future__ import annotations

import pytest
import torch

from stepforge.fused import FusedAdam, FusedLAMB, FusedSGD
from stepforge.testing.tensors import bits_equal


def twins(seed: int = 0):
    torch.manual_seed(seed)
    a = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    b = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    b.load_state_dict(a.state_dict())
    return a, b


def backward(model, x):
    model(x).pow(2).sum().backward()


def _double_float(m):
    m.double().float()


def _half_float(m):
    m.half().float()


def _module_apply(m):
    m._apply(lambda t: t.clone())


def _data_assign(m):
    for p in m.parameters():
        p.data = p.data.clone()  # same values, other memory: a stale pointer would update the old copy


def _data_assign_new_values(m):
    with torch.no_grad():
        for p in m.parameters():
            p.data = p.data * 0.5 + 0.1


MOVES = {
    "double-float": _double_float,
    "half-float": _half_float,
    "module-_apply": _module_apply,
    "p.data=": _data_assign,
    "p.data=new-values": _data_assign_new_values,
}


@pytest.mark.parametrize("move", MOVES.values(), ids=MOVES.keys())
@pytest.mark.parametrize("stable", [False, True], ids=["checked", "assume_stable_grads"])
def test_param_moves_rebuild_and_match_torch(move, stable):
    ours, ref = twins()
    opt = FusedAdam(ours.parameters(), lr=1e-2, weight_decay=0.01, assume_stable_grads=stable)
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    x = torch.randn(8, 16)
    for k in range(4):
        for m, o in ((ours, opt), (ref, torch_opt)):
            o.zero_grad(set_to_none=False)
            backward(m, x)
            if k == 1:
                move(m)
            o.step()
        assert bits_equal(ours.parameters(), ref.parameters()), f"step {k}"
    for p, q in zip(ours.parameters(), ref.parameters(), strict=True):
        assert torch.equal(opt.state[p]["exp_avg_sq"], torch_opt.state[q]["exp_avg_sq"])


def test_grad_data_swapped_under_the_same_tensor_is_read():
    ours, ref = twins(1)
    opt = FusedAdam(ours.parameters(), lr=1e-2)
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0, fused=True)
    x = torch.randn(8, 16)
    for k in range(3):
        for m, o in ((ours, opt), (ref, torch_opt)):
            o.zero_grad(set_to_none=False)
            backward(m, x)
            if k >= 1:
                for p in m.parameters():
                    p.grad.data = p.grad.data * 3.0  # same grad object, other memory and values
            o.step()
        assert bits_equal(ours.parameters(), ref.parameters()), f"step {k}"


def test_param_replaced_by_another_size_fails_with_a_clear_error_not_a_stale_write():
    p = torch.nn.Parameter(torch.randn(10))
    p.grad = torch.randn(10)
    opt = FusedAdam([p], lr=1e-2)
    opt.step()
    p.data = torch.randn(20)  # the grad keeps the old shape
    with pytest.raises(RuntimeError, match="gradient of shape"):
        opt.step()
    p.grad = torch.randn(20)
    with pytest.raises(RuntimeError, match="state cannot follow a change of size"):
        opt.step()
    del opt.state[p]  # what the message says: the parameter then starts afresh, like a new one
    q = torch.nn.Parameter(p.detach().clone())
    q.grad = p.grad.clone()
    torch_opt = torch.optim.AdamW([q], lr=1e-2, weight_decay=0.0, fused=True)
    opt.step()
    torch_opt.step()
    assert torch.equal(p.detach(), q.detach())


def test_grad_replaced_by_another_size_under_the_same_tensor_is_refused():
    p = torch.nn.Parameter(torch.randn(10))
    p.grad = torch.randn(10)
    opt = FusedAdam([p], lr=1e-2)
    opt.step()
    p.grad.data = torch.randn(5)
    with pytest.raises(RuntimeError, match="gradient of shape"):
        opt.step()


def test_dtype_change_moves_state_as_torch_does_and_masters_follow():
    torch.manual_seed(2)
    p = torch.nn.Parameter(torch.randn(64))
    q = torch.nn.Parameter(p.detach().clone())
    opt = FusedAdam([p], lr=1e-2, master_weights=True)
    torch_opt = torch.optim.AdamW([q], lr=1e-2, weight_decay=0.0, fused=True)
    g = torch.randn(64)
    p.grad, q.grad = g.clone(), g.clone()
    opt.step()
    torch_opt.step()
    # fp32 -> bf16: a master is created from the (rounded) parameter; moments stay float32
    p.data = p.data.to(torch.bfloat16)
    p.grad = g.to(torch.bfloat16)
    opt.step()
    assert opt.state[p]["master_param"].dtype == torch.float32
    assert opt.state[p]["exp_avg"].dtype == torch.float32
    assert torch.equal(p.detach(), opt.state[p]["master_param"].to(torch.bfloat16))
    # bf16 -> fp32: the parameter is its own master again
    p.data = p.data.float()
    p.grad = g.clone()
    opt.step()
    assert "master_param" not in opt.state[p]
    assert float(opt.state[p]["step"]) == 3.0


def test_master_resyncs_when_new_values_are_put_into_a_low_precision_param():
    p = torch.nn.Parameter(torch.randn(32).to(torch.bfloat16))
    opt = FusedAdam([p], lr=0.0, master_weights=True)  # lr 0: the step keeps the values
    p.grad = torch.zeros(32, dtype=torch.bfloat16)
    opt.step()
    new = torch.randn(32).to(torch.bfloat16)
    p.data = new.clone()
    opt.step()
    assert torch.equal(p.detach(), new), "the step wrote the stale master back over the new values"


def test_param_moved_to_float64_is_refused_naming_the_fix():
    model = torch.nn.Linear(4, 4)
    opt = FusedAdam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    model.double()
    with pytest.raises(TypeError, match=r"float64.*model.float\(\)"):
        opt.step()


@pytest.mark.parametrize("cls", [FusedSGD, FusedLAMB])
def test_other_optimizers_follow_moves_too(cls):
    ours, ref = twins(3)
    if cls is FusedSGD:
        opt = cls(ours.parameters(), lr=0.1, momentum=0.9)
        torch_opt = cls(ref.parameters(), lr=0.1, momentum=0.9)
    else:
        opt = cls(ours.parameters(), lr=1e-2)
        torch_opt = cls(ref.parameters(), lr=1e-2)
    torch_opt.invalidate_cache()  # the twin rebuilds every step: the reference for "moves seen"
    x = torch.randn(8, 16)
    for k in range(3):
        for m, o in ((ours, opt), (ref, torch_opt)):
            o.zero_grad(set_to_none=False)
            backward(m, x)
            if k == 1 and o is opt:
                m.double().float()
            if o is torch_opt:
                o.invalidate_cache()
            o.step()
        assert bits_equal(ours.parameters(), ref.parameters()), f"step {k}"


def test_zero_grad_set_to_none_drops_the_cached_grads():
    p = torch.nn.Parameter(torch.randn(1000))
    p.grad = torch.randn(1000)
    opt = FusedAdam([p])
    opt.step()
    opt.zero_grad(set_to_none=True)
    entry = next(iter(opt._bucket_cache.entries.values()))
    assert entry.grads == [] and entry.grad_refs == []


def test_a_freed_grad_storage_marks_the_cache_stale():
    p = torch.nn.Parameter(torch.randn(8))
    p.grad = torch.randn(8)
    opt = FusedAdam([p])
    opt.step()
    entry = next(iter(opt._bucket_cache.entries.values()))
    assert not entry.watched, "grads seen once are not watched (fresh grads every step would waste it)"
    opt.step()  # the same grad objects again: from now on their storages are watched
    assert entry.watched and not entry.stale[0]
    p.grad.data = torch.randn(8)  # the old storage dies here
    assert entry.stale[0]
