# SPDX-License-Identifier: Apache-2.0
"""FusedAdam / CPUAdam / HybridAdam: torch parity (bit-identical for fp32), mixed precision, state dicts, errors."""

from __future__ import annotations

import io

import pytest
import torch

from stepforge.core import HyperParameterError, build_optimizer
from stepforge.fused import CPUAdam, FusedAdam, HybridAdam
from stepforge.testing.fused_cases import check_update_close
from stepforge.testing.reference import ReferenceAdam
from stepforge.testing.tensors import bits_equal, clone_params, set_grads

SHAPES = [(3, 5), (17,), (1,), (0,), (40, 33), (1031,), (2, 3, 7)]


def make_params(dtype=torch.float32, shapes=SHAPES):
    return [torch.nn.Parameter(torch.randn(s).to(dtype)) for s in shapes]


@pytest.mark.parametrize("cls", [FusedAdam, CPUAdam, HybridAdam])
@pytest.mark.parametrize(
    "cfg",
    [
        dict(lr=1e-2, weight_decay=0.1),
        dict(lr=3e-3, weight_decay=0.0, betas=(0.3, 0.9)),
        dict(lr=1e-2, weight_decay=0.05, eps=1e-3, betas=(0.8, 0.95)),
    ],
    ids=["wd", "beta1-below-half", "eps"],
)
def test_fp32_bit_identical_to_torch_fused_adamw(isa, cls, cfg):
    ours = make_params()
    ref = clone_params(ours)
    opt = cls(ours, **cfg)
    torch_opt = torch.optim.AdamW(ref, fused=True, **cfg)
    for _ in range(4):
        set_grads(ours, ref)
        opt.step()
        torch_opt.step()
    assert bits_equal(ours, ref)
    for p, q in zip(ours, ref, strict=True):
        assert torch.equal(opt.state[p]["exp_avg"], torch_opt.state[q]["exp_avg"])
        assert torch.equal(opt.state[p]["exp_avg_sq"], torch_opt.state[q]["exp_avg_sq"])
        assert float(opt.state[p]["step"]) == float(torch_opt.state[q]["step"]) == 4.0


def test_l2_mode_bit_identical_to_torch_fused_adam(isa):
    ours = make_params()
    ref = clone_params(ours)
    opt = FusedAdam(ours, lr=1e-2, weight_decay=0.1, adamw_mode=False)
    torch_opt = torch.optim.Adam(ref, lr=1e-2, weight_decay=0.1, fused=True)
    for _ in range(3):
        set_grads(ours, ref)
        opt.step()
        torch_opt.step()
    assert bits_equal(ours, ref)


def test_bias_correction_off_and_per_parameter_steps_match_reference():
    ours = make_params()
    ref = clone_params(ours)
    opt = FusedAdam(ours, lr=1e-2, bias_correction=False, weight_decay=0.01)
    ref_opt = ReferenceAdam(ref, lr=1e-2, bias_correction=False, weight_decay=0.01)
    opt2_params, ref2_params = make_params(), None
    ref2_params = clone_params(opt2_params)
    opt2 = FusedAdam(opt2_params, lr=1e-2)
    ref2 = ReferenceAdam(ref2_params, lr=1e-2)
    for k in range(4):
        set_grads(ours, ref)
        set_grads(opt2_params, ref2_params)
        # parameter 0 gets a gradient only every other step: its own step count drives its bias correction
        if k % 2:
            opt2_params[0].grad = None
            ref2_params[0].grad = None
        opt.step(), ref_opt.step(), opt2.step(), ref2.step()
    for a, b in ((ours, ref), (opt2_params, ref2_params)):
        for p, q in zip(a, b, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert float(opt2.state[opt2_params[0]]["step"]) == 2.0
    assert float(opt2.state[opt2_params[1]]["step"]) == 4.0


@pytest.mark.parametrize("pdt", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("gdt", [None, torch.float32], ids=["grad-same", "grad-fp32"])
def test_low_precision_params_without_masters_match_reference(pdt, gdt):
    ours = make_params(pdt)
    ref = clone_params(ours)
    start = [p.detach().clone() for p in ours]
    opt = FusedAdam(ours, lr=1e-2, weight_decay=0.01)
    ref_opt = ReferenceAdam(
        ref, lr=1e-2, weight_decay=0.01
    )  # same-dtype reference: fp32 math, rounded each step
    for _ in range(3):
        set_grads(ours, ref, dtype=gdt or pdt)
        opt.step()
        ref_opt.step()
    # The error is measured against the update (test_properties.py): a quarter of it plus one ulp per
    # element. The former fixed rtol=atol=1e-2 (bf16) / 2e-3 (fp16) let a do-nothing step through.
    check_update_close(ours, ref, start, f"FusedAdam {pdt}")
    with pytest.raises(AssertionError, match="update"):
        check_update_close(start, ref, start, "do-nothing")
    for p in ours:
        assert p.dtype == pdt
        assert opt.state[p]["exp_avg"].dtype == torch.float32


@pytest.mark.parametrize("pdt", [torch.float16, torch.bfloat16])
def test_master_weights_track_an_fp32_run(pdt):
    ours = make_params(pdt)
    fp32 = [torch.nn.Parameter(p.detach().float().clone()) for p in ours]
    opt = CPUAdam(ours, lr=1e-2, weight_decay=0.01, master_weights=True)
    ref_opt = ReferenceAdam(fp32, lr=1e-2, weight_decay=0.01)
    for _ in range(4):
        set_grads(ours, dtype=pdt)
        for p, q in zip(ours, fp32, strict=True):
            q.grad = p.grad.float()
        opt.step(div_scale=2.0)
        for q in fp32:
            q.grad /= 2.0
        ref_opt.step()
    for p, q in zip(ours, fp32, strict=True):
        master = opt.state[p]["master_param"]
        torch.testing.assert_close(master, q.detach(), rtol=1e-5, atol=1e-6)
        assert torch.equal(p.detach(), master.to(pdt))


def test_master_weights_skip_the_whole_step_on_inf_and_report_it():
    ours = [*make_params(torch.bfloat16), torch.nn.Parameter(torch.randn(9))]  # two buckets
    opt = FusedAdam(ours, lr=1e-2, master_weights=True)
    set_grads(ours)
    opt.step()
    before = [p.detach().clone() for p in ours]
    states = [{k: v.clone() for k, v in opt.state[p].items()} for p in ours]
    set_grads(ours)
    ours[-1].grad[3] = float("nan")  # the last bucket: the first one must not have been updated either
    opt.step()
    assert opt.last_step_skipped and opt.skipped_steps == 1
    assert bits_equal(ours, before)
    for p, st in zip(ours, states, strict=True):
        for k, v in st.items():
            assert torch.equal(opt.state[p][k], v), k
    ours[-1].grad[3] = 0.0
    opt.step()
    assert not opt.last_step_skipped and float(opt.state[ours[0]]["step"]) == 2.0


def test_div_scale_divides_grads_on_every_path():
    ours = make_params()
    ref = clone_params(ours)
    opt = HybridAdam(ours, lr=1e-2)
    torch_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0, fused=True)
    for _ in range(2):
        set_grads(ours, ref, scale=8.0)
        for q in ref:
            q.grad /= 8.0
        opt.step(div_scale=8.0)
        torch_opt.step()
    for p, q in zip(ours, ref, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_reallocated_and_reassigned_grads_are_picked_up():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    ref_model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    ref_model.load_state_dict(model.state_dict())
    opt = FusedAdam(model.parameters(), lr=1e-2)
    torch_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.0, fused=True)
    x = torch.randn(4, 8)
    for k in range(4):
        for m, o in ((model, opt), (ref_model, torch_opt)):
            o.zero_grad(set_to_none=True) if k % 2 else m.zero_grad(set_to_none=False)
            m(x).pow(2).sum().backward()
            o.step()
    assert bits_equal(model.parameters(), ref_model.parameters())
    # grads assigned by hand (new tensors every step) are read, not stale cached pointers
    for _ in range(2):
        set_grads(list(model.parameters()), list(ref_model.parameters()))
        opt.step()
        torch_opt.step()
    assert bits_equal(model.parameters(), ref_model.parameters())


def saved_and_loaded(state_dict):
    # load_state_dict keeps the very tensors it is given: go through bytes like a checkpoint does.
    buf = io.BytesIO()
    torch.save(state_dict, buf)
    buf.seek(0)
    return torch.load(buf)


def test_torch_state_dict_loads_and_continues_identically_both_ways():
    ours = make_params()
    ref = clone_params(ours)
    torch_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, fused=True)
    for _ in range(2):
        set_grads(ref)
        torch_opt.step()
    # torch -> FusedAdam (through torch.save / torch.load)
    with torch.no_grad():
        for p, q in zip(ours, ref, strict=True):
            p.copy_(q)
    opt = FusedAdam(ours, lr=1.0)
    opt.load_state_dict(saved_and_loaded(torch_opt.state_dict()))
    assert opt.param_groups[0]["lr"] == 1e-2 and opt.param_groups[0]["bias_correction"] is True
    for _ in range(2):
        set_grads(ours, ref)
        opt.step()
        torch_opt.step()
    assert bits_equal(ours, ref)
    # FusedAdam -> torch
    back = clone_params(ours)
    torch_back = torch.optim.AdamW(back, lr=5.0, fused=True)
    torch_back.load_state_dict(saved_and_loaded(opt.state_dict()))
    for _ in range(2):
        set_grads(ours, back)
        opt.step()
        torch_back.step()
    assert bits_equal(ours, back)
    assert float(torch_back.state[back[0]]["step"]) == 6.0


def test_low_precision_torch_state_is_widened_on_load():
    p = [torch.nn.Parameter(torch.randn(10).bfloat16())]
    torch_opt = torch.optim.AdamW(p, lr=1e-2)
    p[0].grad = torch.randn(10).bfloat16()
    torch_opt.step()
    opt = FusedAdam(p, lr=1e-2)
    opt.load_state_dict(torch_opt.state_dict())
    p[0].grad = torch.randn(10).bfloat16()
    opt.step()
    assert opt.state[p[0]]["exp_avg"].dtype == torch.float32
    assert float(opt.state[p[0]]["step"]) == 2.0


def test_grad_scaler_integration_matches_unscaled_run():
    model = torch.nn.Linear(6, 4)
    ref_model = torch.nn.Linear(6, 4)
    ref_model.load_state_dict(model.state_dict())
    opt = FusedAdam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x = torch.randn(5, 6)
    for _ in range(3):
        opt.zero_grad()
        ref_opt.zero_grad()
        scaler.scale(model(x).square().mean()).backward()
        scaler.step(opt)
        scaler.update()
        ref_model(x).square().mean().backward()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_build_optimizer_finds_every_entry_point():
    p = make_params()
    for name, cls in [("FusedAdam", FusedAdam), ("CPUAdam", CPUAdam), ("HybridAdam", HybridAdam)]:
        assert type(build_optimizer(dict(type=name, lr=1e-3), p)) is cls


def test_errors_name_the_problem():
    with pytest.raises(HyperParameterError, match="amsgrad=True is not supported"):
        FusedAdam(make_params(), amsgrad=True)
    with pytest.raises(HyperParameterError, match="lr"):
        CPUAdam(make_params(), lr=-1.0)
    with pytest.raises(TypeError, match="legacy argument 'grads'"):
        FusedAdam(make_params()).step(grads=[1])
    with pytest.raises(HyperParameterError, match="nvme_offload_fraction must be in"):
        HybridAdam(make_params(), nvme_offload_fraction=1.5)
    cases = [
        (lambda: torch.nn.Parameter(torch.randn(4, 6).t()), None, "is not contiguous"),
        (
            lambda: torch.nn.Parameter(torch.randn(4, 6)),
            lambda p: torch.randn(6, 4).t(),
            "gradient of .* not contiguous",
        ),
        (
            lambda: torch.nn.Parameter(torch.randn(4, dtype=torch.float64)),
            None,
            "float32, float16 and bfloat16",
        ),
        (lambda: torch.nn.Parameter(torch.randn(4)), lambda p: torch.randn(4).to_sparse(), "sparse gradient"),
        (
            lambda: torch.nn.Parameter(torch.randn(4)),
            lambda p: torch.randn(4, dtype=torch.float64),
            "float32, float16 and bfloat16",
        ),
        (lambda: torch.nn.Parameter(torch.randn(4, device="meta")), None, "only CPU and CUDA"),
    ]
    for make_p, make_g, match in cases:
        p = make_p()
        g = make_g(p) if make_g else torch.zeros_like(p)
        if g.dtype != p.dtype:
            p.grad_dtype = None
        p.grad = g
        with pytest.raises((RuntimeError, TypeError), match=match):
            FusedAdam([p]).step()


def test_assume_stable_grads_follows_backward_reallocations_through_hooks():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    ref_model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    ref_model.load_state_dict(model.state_dict())
    opt = FusedAdam(model.parameters(), lr=1e-2, assume_stable_grads=True)
    torch_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.0, fused=True)
    x = torch.randn(4, 8)
    for k in range(4):
        # model.zero_grad() sets None behind the optimizer's back; backward then allocates new grads
        for m, o in ((model, opt), (ref_model, torch_opt)):
            m.zero_grad(set_to_none=bool(k % 2))
            m(x).pow(2).sum().backward()
            o.step()
    assert bits_equal(model.parameters(), ref_model.parameters())
    # a grad assigned by hand is not seen without invalidate_cache() in this mode
    set_grads(list(model.parameters()), list(ref_model.parameters()))
    opt.invalidate_cache()
    opt.step()
    torch_opt.step()
    assert bits_equal(model.parameters(), ref_model.parameters())


def test_master_weights_state_dict_round_trip_keeps_float32_state():
    ours = make_params(torch.bfloat16)
    opt = FusedAdam(ours, lr=1e-2, master_weights=True)
    for _ in range(2):
        set_grads(ours)
        opt.step()
    twin = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt2 = FusedAdam(twin, lr=1e-2, master_weights=True)
    opt2.load_state_dict(saved_and_loaded(opt.state_dict()))
    for p, q in zip(ours, twin, strict=True):
        for key in ("exp_avg", "exp_avg_sq", "master_param"):
            assert opt2.state[q][key].dtype == torch.float32
            assert torch.equal(opt2.state[q][key], opt.state[p][key]), key
    for _ in range(2):
        set_grads(ours, twin)
        opt.step()
        opt2.step()
    assert bits_equal(ours, twin)


def test_pickle_keeps_options_and_drops_pointer_caches():
    import pickle

    ours = make_params(torch.bfloat16)
    opt = FusedAdam(ours, lr=1e-2, master_weights=True, set_grad_none=False)
    set_grads(ours)
    opt.step()
    clone = pickle.loads(pickle.dumps(opt))
    assert clone.master_weights is True and clone.set_grad_none is False
    assert clone._bucket_cache.entries == {}


def test_a_reassigned_bad_grad_is_still_rejected():
    p = torch.nn.Parameter(torch.randn(4, 6))
    p.grad = torch.randn(4, 6)
    opt = FusedAdam([p])
    opt.step()
    p.grad = torch.randn(6, 4).t()
    with pytest.raises(RuntimeError, match="not contiguous"):
        opt.step()


@pytest.mark.parametrize("assume_stable_grads", [False, True])
def test_optimizer_zero_grad_keeps_buckets_and_follows_params_that_lose_their_grad(assume_stable_grads):
    # The pointer cache survives optimizer.zero_grad(set_to_none=True); a param that gets no grad in a step
    # (an unused branch) must then be skipped, exactly as torch does, never read through a stale pointer.
    torch.manual_seed(0)
    trunk, branch = torch.nn.Linear(8, 8), torch.nn.Linear(8, 3)
    ref_trunk, ref_branch = torch.nn.Linear(8, 8), torch.nn.Linear(8, 3)
    ref_trunk.load_state_dict(trunk.state_dict())
    ref_branch.load_state_dict(branch.state_dict())
    ours = [*trunk.parameters(), *branch.parameters()]
    theirs = [*ref_trunk.parameters(), *ref_branch.parameters()]
    opt = FusedAdam(ours, lr=1e-2, assume_stable_grads=assume_stable_grads)
    torch_opt = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.0, fused=True)
    x = torch.randn(4, 8)
    for k in range(6):
        use_branch = k % 3 != 1
        for t, b, o in ((trunk, branch, opt), (ref_trunk, ref_branch, torch_opt)):
            o.zero_grad(set_to_none=True)
            h = t(x)
            (b(h).pow(2).sum() if use_branch else h.pow(2).sum()).backward()
            o.step()
        assert bits_equal(ours, theirs), f"step {k}"
    assert len(opt._bucket_cache.entries) == 1, "the buckets are kept across zero_grad"
