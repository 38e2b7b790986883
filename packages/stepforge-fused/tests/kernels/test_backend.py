# SPDX-License-Identifier: Apache-2.0
"""Module loading, ISA selection (STEPFORGE_CPU_ISA), threads, device routing, packaging, huge tensors."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import stepforge.fused as fused
from stepforge.fused import BackendUnavailableError, FusedAdam, FusedSGD, _backend
from stepforge.testing.packaging import check_distribution


def test_cpu_features_reports_the_choice():
    info = fused.cpu_features()
    assert info["isa"] in info["supported"]
    assert set(info["supported"]) <= set(info["compiled"]) <= {"scalar", "avx2", "avx512"}
    assert "scalar" in info["supported"]
    assert info["num_threads"] == fused.get_num_threads() >= 1
    if torch.backends.cpu.get_cpu_capability() == "AVX512":
        assert "avx512" in info["supported"]


ENV_SCRIPT = "import stepforge.fused as f; i = f.cpu_features(); print(i['isa'], i['forced_by_env'])"


@pytest.mark.parametrize("name", _backend.cpu_features()["supported"])
def test_env_var_forces_the_path_at_import(name):
    env = {**os.environ, "STEPFORGE_CPU_ISA": name}
    out = subprocess.run(
        [sys.executable, "-c", ENV_SCRIPT], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == [name, name]


def test_env_var_with_unknown_path_fails_loudly():
    env = {**os.environ, "STEPFORGE_CPU_ISA": "sse9"}
    code = "import stepforge.fused as f; f.cpu_features()"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "STEPFORGE_CPU_ISA=sse9 is unknown" in out.stderr


def test_set_isa_rejects_unknown_names():
    with pytest.raises(ValueError, match="unknown ISA"):
        fused.set_cpu_isa("neon9")


def test_threads_default_to_torch_and_can_be_set():
    assert fused.get_num_threads() == torch.get_num_threads()
    fused.set_num_threads(1)
    try:
        assert fused.get_num_threads() == 1
        p = torch.nn.Parameter(torch.randn(70_000))
        q = torch.nn.Parameter(p.detach().clone())
        p.grad = torch.randn(70_000)
        q.grad = p.grad.clone()
        a, b = FusedAdam([p]), torch.optim.AdamW([q], lr=1e-3, weight_decay=0.0, fused=True)
        a.step()
        b.step()
        assert torch.equal(p, q)
    finally:
        fused.set_num_threads(None)
    with pytest.raises(ValueError, match="positive int"):
        fused.set_num_threads(0)


def test_devices_without_kernels_raise_errors_naming_the_fix():
    with pytest.raises(BackendUnavailableError, match="CPU and CUDA tensors only"):
        _backend.module_for(torch.device("meta"))
    if torch.cuda.is_available() and fused.has_cuda():
        pytest.skip("a CUDA device and module are present: the GPU tests cover the CUDA path")
    with pytest.raises(BackendUnavailableError, match=r"STEPFORGE_CUDA=ON|no CUDA device"):
        _backend.module_for(torch.device("cuda"))


def test_distribution_metadata_and_entry_points():
    declared = check_distribution("stepforge-fused")
    assert sorted(declared["stepforge.optimizers"]) == [
        "CPUAdam",
        "FusedAdam",
        "FusedLAMB",
        "FusedSGD",
        "HybridAdam",
    ]


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("STEPFORGE_RUN_SLOW") != "1",
    reason="needs ~8.6 GB of RAM and a few seconds (2^31 + 9 bf16 params and grads); "
    "set STEPFORGE_RUN_SLOW=1 to run",
)
def test_tensor_beyond_int32_indexing_is_updated_to_the_end():
    n = 2**31 + 9
    p = torch.nn.Parameter(torch.zeros(n, dtype=torch.bfloat16))
    p.grad = torch.ones(n, dtype=torch.bfloat16)
    FusedSGD([p], lr=0.5).step()
    for idx in (0, 2**31 - 1, 2**31, n - 1):
        assert p[idx].item() == -0.5, idx
    # the norm kernel reads past 2^31 too
    p.grad[n - 1] = float("inf")
    norm = _backend.cpu_module().l2norm([p.grad.data_ptr()], [n], 2, 0, 0)
    assert norm == float("inf")
