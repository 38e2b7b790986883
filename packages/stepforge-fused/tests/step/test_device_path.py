# SPDX-License-Identifier: Apache-2.0
"""The CUDA (device) path of the optimizer classes, checked on the CPU without a GPU.

The optimizers are told that CPU tensors take the device path, and ``_backend.module_for`` hands them an
emulation of the ``_cuda`` module's contract (csrc/README.md, "_cuda specifics") that works on CPU memory: it
reads ``lr_ptr`` / ``grad_divisor_ptr`` / ``step_ptrs`` from the addresses it is given (as the CUDA kernels read
device memory), passes ``found_inf_ptr`` / ``check_finite`` through (the CPU kernels have the same skip semantics)
and runs the real ``_cpu`` kernels, returning ``None`` like the CUDA launcher does when the skip decision stays on
the device. Every launch's keyword arguments are recorded, and tensor-to-host reads (``.item()``, ``float()``,
``bool()``...) raise inside ``step()``: on a GPU each of them would be a host synchronisation.
"""

from __future__ import annotations

import contextlib
import ctypes
import math

import pytest
import torch

from stepforge.fused import FusedAdam, FusedLAMB, FusedSGD, HybridAdam, _backend
from stepforge.fused._base import FusedOptimizerBase
from stepforge.fused._step.buckets import BucketCache
from stepforge.testing.tensors import bits_equal, make_params
from stepforge.testing.tensors import clone_params as clone

CPU = _backend.cpu_module()


def _f32(ptr: int) -> float:
    return ctypes.c_float.from_address(ptr).value


class EmulatedCuda:
    """The ``_cuda`` launch contract on CPU memory (see module docstring)."""

    DTYPE_FLOAT32, DTYPE_FLOAT16, DTYPE_BFLOAT16 = 0, 1, 2

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []

    def _host(self, name, steps, grad_divisor, lr, found_inf_ptr, check_finite, kw):
        self.calls.append(
            (name, dict(kw, steps=steps, found_inf_ptr=found_inf_ptr, check_finite=check_finite))
        )
        if kw.get("lr_ptr"):
            lr = _f32(kw["lr_ptr"])
        if kw.get("grad_divisor_ptr"):
            grad_divisor = grad_divisor * _f32(kw["grad_divisor_ptr"])
        if kw.get("step_ptrs") is not None:
            assert steps is None or len(steps) == 0
            steps = [int(_f32(p)) for p in kw["step_ptrs"]]
        return steps, grad_divisor, lr

    def adam(self, *args, **kw):
        args = list(args)
        args[6], args[16], args[9] = self._host("adam", args[6], args[16], args[9], args[17], args[18], kw)
        args[19] = 0  # ctx: a stream handle on CUDA, the thread count on CPU
        CPU.adam(*args, write_unscaled_grads=kw.get("write_unscaled_grads", False))
        return None

    def lamb(self, *args, **kw):
        args = list(args)
        args[6], args[20], args[9] = self._host("lamb", args[6], args[20], args[9], args[21], args[22], kw)
        args[23] = 0
        CPU.lamb(*args, write_unscaled_grads=kw.get("write_unscaled_grads", False))
        return None

    def sgd(self, *args, **kw):
        args = list(args)
        _, args[14], args[8] = self._host("sgd", None, args[14], args[8], args[15], args[16], kw)
        args[17] = 0
        CPU.sgd(*args, write_unscaled_grads=kw.get("write_unscaled_grads", False))
        return None

    def l2norm(self, ptrs, sizes, dtype, per_tensor_out_ptr, ctx, *, sumsq_out_ptr=0, device=-1):
        self.calls.append(("l2norm", {"sumsq_out_ptr": sumsq_out_ptr, "device": device}))
        norm = CPU.l2norm(ptrs, sizes, dtype, 0, 0)
        if not sumsq_out_ptr:
            return norm  # a host read: only the mixed CPU + device path (HybridAdam offload) does that
        out = ctypes.c_float.from_address(sumsq_out_ptr)
        out.value = out.value + norm * norm
        return None


@pytest.fixture
def emu(monkeypatch):
    fake = EmulatedCuda()
    monkeypatch.setattr(FusedOptimizerBase, "_device_path", staticmethod(lambda device: True))
    monkeypatch.setattr(FusedOptimizerBase, "_device_env", staticmethod(lambda device: (12345, 0)))
    monkeypatch.setattr(_backend, "module_for", lambda device: fake)
    return fake


def _no_host_reads(*_a, **_k):
    raise AssertionError("a tensor was read on the host inside step() (a host synchronisation on CUDA)")


@contextlib.contextmanager
def no_sync(monkeypatch):
    with monkeypatch.context() as m:
        for name in ("item", "tolist", "__float__", "__int__", "__bool__", "__index__"):
            m.setattr(torch.Tensor, name, _no_host_reads)
        yield


def make(dtype=torch.float32, shapes=((5,), (3, 7), (33,)), seed=0):
    return make_params(shapes, dtype, seed=seed)


def grads(ps, seed, dtype=None):
    gen = torch.Generator().manual_seed(100 + seed)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=gen).to(dtype or p.dtype)


LR = 2.0**-10  # exact in float32: the device lr gives the same bits as the host double


@pytest.mark.parametrize("capturable", [False, True])
def test_adam_device_path_matches_torch_without_host_reads(emu, monkeypatch, capturable):
    ours, ref = make(), make()
    opt = FusedAdam(ours, lr=LR, weight_decay=0.1, capturable=capturable)
    ref_opt = torch.optim.AdamW(ref, lr=LR, weight_decay=0.1, fused=True)
    for s in range(3):
        grads(ours, s)
        grads(ref, s)
        with no_sync(monkeypatch):
            opt.step()
        ref_opt.step()
    assert bits_equal(ours, ref)
    launches = [kw for name, kw in emu.calls if name == "adam"]
    assert len(launches) == 3
    for kw in launches:
        assert kw["steps"] is None and kw["step_ptrs"] is not None and kw["device"] == 0
        assert bool(kw.get("lr_ptr")) == capturable
    steps = [opt.state[p]["step"] for p in ours]
    assert all(s.dtype == torch.float32 and s.dim() == 0 and float(s) == 3.0 for s in steps)


def test_overflow_skip_single_bucket_uses_the_device_flag_and_rolls_steps_back(emu, monkeypatch):
    ours = make()
    opt = FusedAdam(ours, lr=LR, skip_nonfinite=True)
    grads(ours, 0)
    opt.step()
    before = [p.detach().clone() for p in ours]
    grads(ours, 1)
    ours[1].grad[2, 3] = float("inf")
    with no_sync(monkeypatch):
        opt.step()
    kw = [kw for name, kw in emu.calls if name == "adam"][-1]
    assert kw["found_inf_ptr"] != 0 and kw["check_finite"]  # one bucket: the kernel's own check sets the flag
    assert bits_equal(ours, before)
    assert [float(opt.state[p]["step"]) for p in ours] == [1.0, 1.0, 1.0]
    assert opt.last_step_skipped and opt.skipped_steps == 1
    grads(ours, 2)
    opt.step()
    assert not opt.last_step_skipped and opt.skipped_steps == 1
    assert [float(opt.state[p]["step"]) for p in ours] == [2.0, 2.0, 2.0]


def test_overflow_skip_over_several_buckets_checks_all_first_on_the_device(emu, monkeypatch):
    ours = [*make(torch.bfloat16), *make(seed=1)]  # two buckets (bf16 with masters, fp32)
    opt = FusedAdam(ours, lr=LR, master_weights=True)
    grads(ours, 0)
    opt.step()
    before = [p.detach().clone() for p in ours]
    emu.calls.clear()
    grads(ours, 1)
    ours[-1].grad[0] = float("nan")  # in the last bucket: the first one must not be written either
    with no_sync(monkeypatch):
        opt.step()
    names = [name for name, _ in emu.calls]
    assert names == ["l2norm", "l2norm", "adam", "adam"]
    assert all(kw["sumsq_out_ptr"] for name, kw in emu.calls if name == "l2norm")
    adam = [kw for name, kw in emu.calls if name == "adam"]
    assert all(kw["found_inf_ptr"] != 0 and not kw["check_finite"] for kw in adam)
    assert bits_equal(ours, before)
    assert opt.last_step_skipped and opt.skipped_steps == 1
    assert all(float(opt.state[p]["step"]) == 1.0 for p in ours)


def test_grad_scaler_tensors_stay_on_the_device(emu, monkeypatch):
    ours, ref = make(), make()
    opt = FusedAdam(ours, lr=LR)
    ref_opt = FusedAdam(ref, lr=LR)
    grads(ours, 0)
    # What torch.amp.GradScaler sets before calling step() (scaled grads, scale 8, no overflow).
    opt.grad_scale = torch.tensor([8.0])
    opt.found_inf = torch.tensor([0.0])
    with no_sync(monkeypatch):
        opt.step()
    kw = [kw for name, kw in emu.calls if name == "adam"][-1]
    assert kw["grad_divisor_ptr"] != 0 and kw["found_inf_ptr"] != 0
    grads(ref, 0)
    ref_opt.step(div_scale=8.0)
    assert bits_equal(ours, ref)
    before = [p.detach().clone() for p in ours]
    opt.found_inf = torch.tensor([1.0])  # the scaler saw an overflow: skipped on the device
    with no_sync(monkeypatch):
        opt.step()
    assert bits_equal(ours, before) and opt.last_step_skipped
    assert all(float(opt.state[p]["step"]) == 1.0 for p in ours)


@pytest.mark.parametrize("max_grad_norm", [0.0, 0.5, 1e6])
def test_lamb_clip_factor_is_computed_on_the_device(emu, monkeypatch, max_grad_norm):
    ours = make()
    ref = clone(ours)
    opt = FusedLAMB(ours, lr=1e-2, max_grad_norm=max_grad_norm)
    for s in range(2):
        grads(ours, s)
        with no_sync(monkeypatch):
            opt.step(div_scale=2.0)
    launches = [kw for name, kw in emu.calls if name == "lamb"]
    assert all(kw["sumsq_out_ptr"] for name, kw in emu.calls if name == "l2norm")
    assert all(bool(kw.get("grad_divisor_ptr")) == (max_grad_norm > 0) for kw in launches)
    monkeypatch.undo()  # the host (CPU) path as the reference
    ref_opt = FusedLAMB(ref, lr=1e-2, max_grad_norm=max_grad_norm)
    for s in range(2):
        grads(ref, s)
        ref_opt.step(div_scale=2.0)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sgd_device_path_matches_torch_and_skips_on_the_device(emu, monkeypatch, momentum):
    ours, ref = make(), make()
    opt = FusedSGD(ours, lr=0.1, momentum=momentum, skip_nonfinite=True, capturable=True)
    ref_opt = torch.optim.SGD(ref, lr=0.1, momentum=momentum)
    for s in range(3):
        grads(ours, s)
        grads(ref, s)
        with no_sync(monkeypatch):
            opt.step()
        ref_opt.step()
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)
    before = [p.detach().clone() for p in ours]
    grads(ours, 9)
    ours[0].grad[1] = float("nan")
    with no_sync(monkeypatch):
        opt.step()
    assert bits_equal(ours, before) and opt.skipped_steps == 1
    assert all(kw.get("lr_ptr") for name, kw in emu.calls if name == "sgd")


@pytest.mark.parametrize("kind", ["tensor", "float"])
def test_device_lr_follows_changes(emu, kind):
    ours, ref = make(), make()
    lr = torch.tensor(LR) if kind == "tensor" else LR
    opt = FusedAdam(ours, lr=lr, capturable=True)
    ref_opt = torch.optim.AdamW(ref, lr=LR, weight_decay=0.0, fused=True)
    for s in range(2):
        grads(ours, s)
        grads(ref, s)
        opt.step()
        ref_opt.step()
        if kind == "tensor":
            lr.fill_(LR / 2)  # what a CUDA-graph user does between replays: the kernel reads it in place
        else:
            opt.param_groups[0]["lr"] = LR / 2  # a scheduler: the device buffer is refreshed (eager steps)
        ref_opt.param_groups[0]["lr"] = LR / 2
    assert bits_equal(ours, ref)


def test_capturable_state_dict_interchanges_with_torch(emu):
    ref = make()
    ref_opt = torch.optim.AdamW(ref, lr=LR, fused=True)
    for s in range(6):
        grads(ref, s)
        ref_opt.step()
    # torch (2 steps) -> FusedAdam(capturable) on the device path (2 steps) -> torch (2 steps)
    a = make()
    a_opt = torch.optim.AdamW(a, lr=LR, fused=True)
    for s in range(2):
        grads(a, s)
        a_opt.step()
    b = clone(a)
    b_opt = FusedAdam(b, lr=LR, capturable=True)
    b_opt.load_state_dict(a_opt.state_dict())
    for s in range(2, 4):
        grads(b, s)
        b_opt.step()
    sd = b_opt.state_dict()
    assert sd["param_groups"][0]["capturable"] is True
    assert all(st["step"].dtype == torch.float32 and st["step"].dim() == 0 for st in sd["state"].values())
    c = clone(b)
    c_opt = torch.optim.AdamW(c, lr=LR, fused=True)
    c_opt.load_state_dict(sd)
    c_opt.param_groups[0]["capturable"] = False  # torch's CPU AdamW cannot be capturable
    for s in range(4, 6):
        grads(c, s)
        c_opt.step()
    assert bits_equal(c, ref)


def test_hybrid_adam_takes_the_device_path_for_device_params(emu, monkeypatch):
    ours, ref = make(), make()
    opt = HybridAdam(ours, lr=LR)
    ref_opt = torch.optim.AdamW(ref, lr=LR, weight_decay=0.0, fused=True)
    grads(ours, 0)
    grads(ref, 0)
    with no_sync(monkeypatch):
        opt.step()
    ref_opt.step()
    assert bits_equal(ours, ref)


def test_capturable_rejects_cpu_params_naming_the_fix():
    ps = make()
    grads(ps, 0)
    for opt in (
        FusedAdam(ps, capturable=True),
        FusedSGD(ps, lr=0.1, capturable=True),
        FusedLAMB(ps, capturable=True),
    ):
        with pytest.raises(RuntimeError, match="capturable=True needs CUDA parameters.*capturable=False"):
            opt.step()
    with pytest.raises(ValueError, match="capturable"):
        FusedAdam(ps, capturable="yes")


def test_cpu_path_keeps_host_steps_and_no_device_arguments():
    ps = make()
    opt = FusedAdam(ps, lr=LR)
    grads(ps, 0)
    opt.step()
    assert all(opt.state[p]["step"].device.type == "cpu" for p in ps)
    assert not any(b.on_device for b in opt._bucket_cache.entries[0].buckets)
    assert math.isclose(float(opt.state[ps[0]]["step"]), 1.0)


@pytest.fixture
def mixed(monkeypatch):
    """Group 0 takes the device path (emulated), group 1 the CPU kernels: HybridAdam's offload layout."""
    fake = EmulatedCuda()
    flag = {"device": False}
    real_build = BucketCache.build

    def build(self, opt, group, params, grads, *rest):
        flag["device"] = group is opt.param_groups[0]
        try:
            return real_build(self, opt, group, params, grads, *rest)
        finally:
            flag["device"] = False

    monkeypatch.setattr(BucketCache, "build", build)
    monkeypatch.setattr(FusedOptimizerBase, "_device_path", staticmethod(lambda device: flag["device"]))
    monkeypatch.setattr(FusedOptimizerBase, "_device_env", staticmethod(lambda device: (12345, 0)))
    monkeypatch.setattr(FusedOptimizerBase, "_ctx", staticmethod(lambda module, device: 0))
    real_for = _backend.module_for
    monkeypatch.setattr(_backend, "module_for", lambda device: fake if flag["device"] else real_for(device))
    return fake, flag  # (host-path l2norm checks of the device bucket run on the real CPU kernels)


def test_mixed_cpu_and_device_params_step_and_skip_together(mixed, monkeypatch):
    fake, _ = mixed
    dev, cpu = make(), make(seed=3)
    ref_dev, ref_cpu = clone(dev), clone(cpu)
    opt = HybridAdam([{"params": dev}, {"params": cpu}], lr=LR, master_weights=True)
    ref = torch.optim.AdamW([*ref_dev, *ref_cpu], lr=LR, weight_decay=0.0, fused=True)
    # module_for picks the emulation by bucket: route the device bucket's launches there during step().
    real_launch = HybridAdam._launch

    def launch(self, module, bucket, *args):
        return real_launch(self, fake if bucket.on_device else module, bucket, *args)

    monkeypatch.setattr(HybridAdam, "_launch", launch)
    for s in range(2):
        grads(dev, s)
        grads(cpu, 10 + s)
        grads(ref_dev, s)
        grads(ref_cpu, 10 + s)
        opt.step()
        ref.step()
    assert bits_equal([*dev, *cpu], [*ref_dev, *ref_cpu])
    assert [b.on_device for g in opt._bucket_cache.entries.values() for b in g.buckets] == [True, False]
    assert all(float(opt.state[p]["step"]) == 2.0 for p in [*dev, *cpu])
    before = [p.detach().clone() for p in [*dev, *cpu]]
    grads(dev, 5)
    grads(cpu, 6)
    cpu[0].grad[0] = float("inf")  # the host check sees it before any bucket is written
    opt.step()
    assert bits_equal([*dev, *cpu], before) and opt.last_step_skipped and opt.skipped_steps == 1
    assert all(float(opt.state[p]["step"]) == 2.0 for p in [*dev, *cpu])
    launches = [kw for name, kw in fake.calls if name == "adam"]
    assert launches and all(kw["step_ptrs"] is not None and kw["steps"] is None for kw in launches)
