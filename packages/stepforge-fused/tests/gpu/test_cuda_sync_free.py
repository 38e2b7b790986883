# SPDX-License-Identifier: Apache-2.0
"""The CUDA step has no host synchronisation, can be captured in a CUDA graph (``capturable=True``), and keeps
torch.optim's state layout (``gpu`` marker: skips without a device, fails under ``STEPFORGE_REQUIRE_CUDA=1``).

Two guards: ``torch.cuda.set_sync_debug_mode("error")`` makes every synchronising torch call raise, and a proxy
around the ``_cuda`` module asserts that each launch returns ``None`` (the launcher only returns a bool after
reading its overflow flag back, a synchronisation torch cannot see) and that ``l2norm`` accumulates on the
device (``sumsq_out_ptr``).
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

pytestmark = pytest.mark.gpu

SHAPES = [(7,), (33, 5), (16385,), (2, 4099)]


@pytest.fixture
def fused(cuda_mod):
    import stepforge.fused as module

    return module


class NoReadbackModule:
    """Delegates to ``_cuda`` and fails on any launch whose result had to be read back to the host."""

    def __init__(self, module):
        self._module = module
        self.calls: list[tuple[str, dict]] = []

    def __getattr__(self, name):
        target = getattr(self._module, name)
        if name not in ("adam", "sgd", "lamb", "l2norm"):
            return target

        def call(*args, **kw):
            self.calls.append((name, kw))
            result = target(*args, **kw)
            assert result is None, f"_cuda.{name} returned {result!r}: its result was read back (a sync)"
            return result

        return call


@pytest.fixture
def guard(cuda_mod, monkeypatch):
    from stepforge.fused import _backend

    proxy = NoReadbackModule(cuda_mod)
    real = _backend.module_for
    monkeypatch.setattr(_backend, "module_for", lambda d: proxy if d.type == "cuda" else real(d))
    return proxy


@contextlib.contextmanager
def no_sync():
    torch.cuda.synchronize()
    try:
        # torch warns that the debug mode is a prototype: an error under this suite's -W error
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Synchronization debug mode", category=UserWarning)
            torch.cuda.set_sync_debug_mode("error")
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def params(dtype=torch.float32, device="cuda", seed=0, shapes=SHAPES):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(device=device, dtype=dtype).requires_grad_() for s in shapes]


def clone(ps, device=None):
    return [p.detach().to(device or p.device).clone().requires_grad_() for p in ps]


def grads(ps, step, nonfinite=None):
    gen = torch.Generator().manual_seed(1000 + step)
    for i, p in enumerate(ps):
        g = torch.randn(p.shape, generator=gen)
        if nonfinite is not None and i == nonfinite[0]:
            g.view(-1)[0] = nonfinite[1]
        p.grad = g.to(device=p.device, dtype=p.dtype)


def close(a, b, rtol=1e-5, atol=1e-6):
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x.detach().cpu().float(), y.detach().cpu().float(), rtol=rtol, atol=atol)


def build(fused, name, ps, **kw):
    if name == "adam":
        return fused.FusedAdam(ps, lr=1e-3, weight_decay=0.01, **kw)
    if name == "sgd":
        return fused.FusedSGD(ps, lr=0.05, momentum=0.9, **kw)
    if name == "lamb":
        return fused.FusedLAMB(ps, lr=1e-3, max_grad_norm=1.0, **kw)
    kw.pop("capturable", None)
    return fused.HybridAdam(ps, lr=1e-3, weight_decay=0.01, **kw)


NAMES = ["adam", "sgd", "lamb", "hybrid"]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("capturable", [False, True])
def test_step_never_synchronises_and_matches_the_cpu_path(fused, guard, name, capturable):
    gpu = params()
    cpu = clone(gpu, "cpu")
    opt = build(fused, name, gpu, capturable=capturable)
    ref = build(fused, name, cpu)
    for s in range(3):
        grads(gpu, s)
        grads(cpu, s)
        with no_sync():
            opt.step()
        ref.step()
    torch.cuda.synchronize()
    close(gpu, cpu, rtol=1e-4, atol=1e-5)
    launches = [kw for n, kw in guard.calls if n != "l2norm"]
    assert launches and all("device" in kw for kw in launches)
    if name != "sgd":
        assert all(kw.get("step_ptrs") is not None for kw in launches)
        for p in gpu:
            step = opt.state[p]["step"]
            assert step.is_cuda and step.dtype == torch.float32 and step.dim() == 0 and float(step) == 3.0
    if capturable and name != "hybrid":  # HybridAdam has no capturable option (CPU params are its point)
        assert all(kw.get("lr_ptr") for kw in launches)
    if name == "lamb":
        assert all(kw.get("grad_divisor_ptr") for kw in launches)  # the clip factor, computed on the device


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("layout", ["one bucket", "two buckets with masters"])
def test_overflow_skip_is_decided_on_the_device(fused, guard, name, layout):
    if layout == "one bucket":
        ps = params()
        opt = build(fused, name, ps, skip_nonfinite=True)
    else:
        ps = [*params(torch.bfloat16), *params(seed=1)]
        opt = build(fused, name, ps, master_weights=True)
    grads(ps, 0)
    opt.step()
    before = [p.detach().clone() for p in ps]
    states = [{k: v.clone() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)} for p in ps]
    grads(ps, 1, nonfinite=(len(ps) - 1, float("nan")))  # in the last bucket
    with no_sync():
        opt.step()
    torch.cuda.synchronize()
    assert all(torch.equal(p.detach(), b) for p, b in zip(ps, before, strict=True))
    for p, st in zip(ps, states, strict=True):
        for k, v in st.items():
            assert torch.equal(opt.state[p][k], v), k
    assert opt.last_step_skipped and opt.skipped_steps == 1
    grads(ps, 2)
    with no_sync():
        opt.step()
    assert not opt.last_step_skipped and opt.skipped_steps == 1
    if name != "sgd":
        assert all(float(opt.state[p]["step"]) == 2.0 for p in ps)


@pytest.mark.parametrize("name", ["adam", "sgd", "lamb"])
@pytest.mark.parametrize("overflow", [False, True])
def test_grad_scaler_step_is_sync_free_and_matches_unscaled_steps(fused, guard, name, overflow):
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).cuda()
    ref_model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).cuda()
    ref_model.load_state_dict(model.state_dict())
    opt = build(fused, name, list(model.parameters()))
    ref_opt = build(fused, name, list(ref_model.parameters()))
    scaler = torch.amp.GradScaler("cuda", init_scale=1024.0)
    x, y = torch.randn(8, 16, device="cuda"), torch.randn(8, 4, device="cuda")
    torch.nn.functional.mse_loss(ref_model(x), y).backward()
    scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
    if overflow:
        next(model.parameters()).grad.view(-1)[0] = float("inf")
    before = [p.detach().clone() for p in model.parameters()]
    with no_sync():
        scaler.step(opt)
    scaler.update()
    if overflow:
        assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before, strict=True))
        assert opt.last_step_skipped and scaler.get_scale() == 512.0
    else:
        ref_opt.step()
        close(list(model.parameters()), list(ref_model.parameters()))
        assert not opt.last_step_skipped
    assert any(kw.get("grad_divisor_ptr") for n, kw in guard.calls if n != "l2norm")


@pytest.mark.parametrize("name", ["adam", "sgd", "lamb"])
@pytest.mark.parametrize("master", [False, True])
def test_cuda_graph_capture_and_replay_match_eager_steps(fused, name, master):
    dtype = torch.bfloat16 if master else torch.float32
    captured, eager = params(dtype), params(dtype)
    lr = torch.tensor(1e-3 if name != "sgd" else 0.05, device="cuda")
    kw = dict(capturable=True, master_weights=master)
    opt = build(fused, name, captured, **kw)
    opt.param_groups[0]["lr"] = lr
    ref = build(fused, name, eager, **kw)
    grads(captured, 0)  # static grads: replays read whatever was copied into them
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up on the capture stream (state, launch tables)
        for s in range(2):
            grads(eager, s)
            for p, q in zip(captured, eager, strict=True):
                p.grad.copy_(q.grad)
            opt.step()
            ref.step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        opt.step()
    for s in range(2, 6):
        grads(eager, s)
        for p, q in zip(captured, eager, strict=True):
            p.grad.copy_(q.grad)
        if s == 4:  # a schedule change between replays, seen through the device lr
            lr.mul_(0.5)
            ref.param_groups[0]["lr"] = float(ref.param_groups[0]["lr"]) * 0.5
        graph.replay()
        ref.step()
    torch.cuda.synchronize()
    close(captured, eager, rtol=1e-6, atol=1e-7)
    if name != "sgd":
        assert all(float(opt.state[p]["step"]) == 6.0 for p in captured)


def test_graph_replay_skips_on_overflow_and_counts_it(fused):
    ps = params()
    opt = fused.FusedAdam(ps, lr=1e-3, capturable=True, skip_nonfinite=True)
    grads(ps, 0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        opt.step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        opt.step()
    before = [p.detach().clone() for p in ps]
    ps[0].grad.view(-1)[0] = float("inf")
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(p.detach(), b) for p, b in zip(ps, before, strict=True))
    assert opt.last_step_skipped and opt.skipped_steps == 1
    assert all(float(opt.state[p]["step"]) == 1.0 for p in ps)
    ps[0].grad.view(-1)[0] = 0.0
    graph.replay()
    torch.cuda.synchronize()
    assert not opt.last_step_skipped and all(float(opt.state[p]["step"]) == 2.0 for p in ps)


def test_capturable_state_dict_interchanges_with_torch_capturable_adamw(fused):
    hp = dict(lr=1e-3, weight_decay=0.01)
    ref = params()
    ref_opt = torch.optim.AdamW(ref, capturable=True, **hp)
    for s in range(6):
        grads(ref, s)
        ref_opt.step()
    a = params()
    a_opt = torch.optim.AdamW(a, capturable=True, **hp)
    for s in range(2):
        grads(a, s)
        a_opt.step()
    b = clone(a)
    b_opt = fused.FusedAdam(b, capturable=True, **hp)
    b_opt.load_state_dict(a_opt.state_dict())
    for s in range(2, 4):
        grads(b, s)
        b_opt.step()
    sd = b_opt.state_dict()
    for st in sd["state"].values():
        assert st["step"].is_cuda and st["step"].dtype == torch.float32 and st["step"].dim() == 0
    c = clone(b)
    c_opt = torch.optim.AdamW(c, capturable=True, **hp)
    c_opt.load_state_dict(sd)
    for s in range(4, 6):
        grads(c, s)
        c_opt.step()
    close(c, ref)
    assert all(float(c_opt.state[p]["step"]) == 6.0 for p in c)


def test_torch_cpu_steps_load_into_cuda_params(fused):
    # torch's default (foreach, non-capturable) AdamW keeps steps on the CPU: they move to the device once.
    hp = dict(lr=1e-3, weight_decay=0.01)
    ref = params()
    ref_opt = torch.optim.AdamW(ref, foreach=True, **hp)
    a = params()
    a_opt = torch.optim.AdamW(a, foreach=True, **hp)
    for s in range(2):
        grads(ref, s)
        ref_opt.step()
        grads(a, s)
        a_opt.step()
    b = clone(a)
    b_opt = fused.FusedAdam(b, **hp)
    b_opt.load_state_dict(a_opt.state_dict())
    for s in range(2, 4):
        grads(ref, s)
        ref_opt.step()
        grads(b, s)
        b_opt.step()
    close(b, ref)
    assert all(b_opt.state[p]["step"].is_cuda for p in b)
