# SPDX-License-Identifier: Apache-2.0
"""The CUDA kernels called directly through the contract (csrc/README.md), on CUDA tensors: l2norm, scale, CUDA graphs, 64-bit indexing, CPU vs GPU.

References are independent: ``torch.optim`` (fused CUDA AdamW/SGD) and the plain loops of
``stepforge.testing.reference``. Every test needs a device (``gpu`` marker); without one they skip with the
reason, and under ``STEPFORGE_REQUIRE_CUDA=1`` the skip is a failure.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from stepforge.testing.fused_cuda_cases import (
    CODES,
    SHAPES,
    adam_call,
    clone_all,
    ctx,
    make,
    ptrs,
    sizes,
)

pytestmark = pytest.mark.gpu


def test_status_names_the_device_before_torch_touches_it(cuda_mod, tmp_path):
    # A fresh process: the C++ status string this replaced crashed one on an H200.
    code = "from stepforge.fused import _backend as b; print(b.cuda_status())"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    major, minor = torch.cuda.get_device_capability(0)
    assert f"0={torch.cuda.get_device_name(0)} sm_{major}{minor}" in proc.stdout, proc.stdout
    assert f"sm_{major}{minor} (cubin)" in proc.stdout and "(static runtime)" in proc.stdout, proc.stdout


# ---- l2norm / scale ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_l2norm_global_and_per_tensor(cuda_mod, dtype):
    xs = make(SHAPES, dtype)
    per = torch.empty(len(xs), device="cuda")
    total = cuda_mod.l2norm(ptrs(xs), sizes(xs), CODES[dtype], per.data_ptr(), ctx())
    expect = [torch.linalg.vector_norm(x.double()).item() for x in xs]
    assert total == pytest.approx(sum(e * e for e in expect) ** 0.5, rel=1e-5)
    torch.testing.assert_close(
        per.double(), torch.tensor(expect, device="cuda", dtype=torch.float64), rtol=1e-5, atol=1e-6
    )


def test_l2norm_accumulates_buckets_on_device(cuda_mod):
    a = make(SHAPES, torch.float32)
    b = make(SHAPES, torch.bfloat16)
    sumsq = torch.zeros(1, device="cuda")
    assert cuda_mod.l2norm(ptrs(a), sizes(a), 0, 0, ctx(), sumsq_out_ptr=sumsq.data_ptr()) is None
    assert cuda_mod.l2norm(ptrs(b), sizes(b), 2, 0, ctx(), sumsq_out_ptr=sumsq.data_ptr()) is None
    expect = sum(float(x.double().pow(2).sum()) for x in a + b)
    assert sumsq.item() == pytest.approx(expect, rel=1e-5)


def test_scale_unscale_with_inf_flag(cuda_mod):
    src = make(SHAPES, torch.float16, scale=100.0)
    dst = [torch.empty(t.shape, device="cuda") for t in src]
    flag = torch.zeros(1, device="cuda")
    cuda_mod.scale(ptrs(src), ptrs(dst), sizes(src), 1, 0, 1 / 64, flag.data_ptr(), ctx())
    assert flag.item() == 0.0
    for s, d in zip(src, dst, strict=True):
        torch.testing.assert_close(d, s.float() / 64, rtol=0, atol=0)
    src[3][0, 0] = float("nan")
    cuda_mod.scale(ptrs(src), ptrs(src), sizes(src), 1, 1, 0.5, flag.data_ptr(), ctx())
    assert flag.item() == 1.0


# ---- CUDA graphs ------------------------------------------------------------------------------------------
def test_adam_graph_capture_with_device_lr_and_steps(cuda_mod):
    from stepforge.testing.fused_cuda import device_step_ptrs, increment_device_steps

    shapes = [(1000,), (17, 33), (16385,)]
    p = make(shapes, torch.float32)
    ref = [t.clone().requires_grad_() for t in p]
    opt = torch.optim.AdamW(ref, lr=1e-3, weight_decay=0.01, fused=True)
    g = [torch.zeros(s, device="cuda") for s in shapes]
    m = [torch.zeros_like(t) for t in p]
    v = [torch.zeros_like(t) for t in p]
    steps = [torch.zeros((), device="cuda") for _ in p]
    lr = torch.tensor([1e-3], device="cuda")
    found_inf = torch.zeros(1, device="cuda")

    def step():
        increment_device_steps(steps, found_inf)
        cuda_mod.adam(
            ptrs(p),
            ptrs(g),
            ptrs(m),
            ptrs(v),
            None,
            sizes(p),
            None,
            0,
            0,
            1e-3,
            0.9,
            0.999,
            1e-8,
            0.01,
            True,
            True,
            1.0,
            found_inf.data_ptr(),
            False,
            ctx(),
            lr_ptr=lr.data_ptr(),
            step_ptrs=device_step_ptrs(steps),
            device=torch.cuda.current_device(),  # no pointer-attribute query inside the capture
        )

    # Launch tables are cached per stream: warm up on the stream the graph is captured on.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        snapshot = [clone_all(x) for x in (p, m, v)] + [clone_all(steps)]
        step()  # warm-up: uploads the launch table outside the capture
        for dst, src in zip((p, m, v, steps), snapshot, strict=True):
            for d, s in zip(dst, src, strict=True):
                d.copy_(s)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        step()
    for _ in range(3):
        new = make(shapes, torch.float32)
        for gi, r, n in zip(g, ref, new, strict=True):
            gi.copy_(n)
            r.grad = n.clone()
        opt.step()
        graph.replay()
    torch.cuda.synchronize()
    assert [s.item() for s in steps] == [3.0, 3.0, 3.0]
    for a, b in zip(p, ref, strict=True):
        torch.testing.assert_close(a, b.detach(), rtol=1e-6, atol=1e-7)


# ---- 64-bit indexing --------------------------------------------------------------------------------------
@pytest.mark.slow
def test_tensor_above_2_pow_31_elements(cuda_mod):
    from stepforge.testing.gpu import optional_skip

    n = (1 << 31) + 4099
    need = n * 4 * 2 + (1 << 30)
    free, _ = torch.cuda.mem_get_info()
    if free < need:
        optional_skip(f"needs {need / 2**30:.1f} GiB free device memory, {free / 2**30:.1f} GiB available")
    p = torch.zeros(n, device="cuda")
    g = torch.ones(n, device="cuda")
    cuda_mod.sgd(
        [p.data_ptr()],
        [g.data_ptr()],
        None,
        None,
        [n],
        None,
        0,
        0,
        1.0,
        0.0,
        0.0,
        0.0,
        False,
        False,
        1.0,
        0,
        False,
        ctx(),
    )
    torch.cuda.synchronize()
    # Every element moved, including those past 2**31 (a 32-bit index would wrap or stop there).
    assert (
        p[-4099:].eq(-1.0).all()
        and p[:4099].eq(-1.0).all()
        and p[(1 << 31) - 2 : (1 << 31) + 2].eq(-1.0).all()
    )
    assert p.sum(dtype=torch.float64).item() == -n
    norm = cuda_mod.l2norm([g.data_ptr()], [n], 0, 0, ctx())
    assert norm == pytest.approx(n**0.5, rel=1e-6)


# ---- CPU vs GPU -------------------------------------------------------------------------------------------
def test_cpu_and_cuda_modules_agree(cuda_mod):
    cpu_mod = pytest.importorskip("stepforge.fused._cpu", reason="the _cpu module is not built")
    p = make(SHAPES, torch.float32, device="cpu")
    g = make(SHAPES, torch.float32, device="cpu")
    m = [torch.zeros_like(t) for t in p]
    v = [torch.zeros_like(t) for t in p]
    cp, cg, cm, cv = ([t.cuda() for t in x] for x in (p, g, m, v))
    for step in (1, 2):
        cpu_mod.adam(
            ptrs(p),
            ptrs(g),
            ptrs(m),
            ptrs(v),
            None,
            sizes(p),
            [step] * len(p),
            0,
            0,
            1e-3,
            0.9,
            0.999,
            1e-8,
            0.01,
            True,
            True,
            1.0,
            0,
            False,
            0,
        )
        adam_call(cuda_mod, cp, cg, cm, cv, [step] * len(p))
    torch.cuda.synchronize()
    for a, b in zip(p + m + v, cp + cm + cv, strict=True):
        torch.testing.assert_close(a, b.cpu(), rtol=1e-6, atol=1e-7)
