# SPDX-License-Identifier: Apache-2.0
"""NVMe offload of CPUAdam / HybridAdam state (``_nvme.py``): trajectory, memory, files, checkpoints, errors."""

from __future__ import annotations

import copy
import gc
import io
import os
import subprocess
import sys

import pytest
import torch

from stepforge.core import HyperParameterError
from stepforge.fused import CPUAdam, HybridAdam


def _params(sizes=(40_000, 3_000, 257, 16)):
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(n)) for n in sizes]


def _run(opt, params, steps=4, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.step()


def _is_file_backed(t: torch.Tensor, directory: str) -> bool:
    """Whether t's memory is a shared mapping of a file under `directory` (from /proc/self/maps)."""
    addr = t.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= addr < hi:
                return len(fields) >= 6 and fields[5].startswith(directory) and fields[1][3] == "s"
    return False


@pytest.mark.parametrize("cls", [CPUAdam, HybridAdam])
def test_offloaded_state_gives_the_same_trajectory_bit_for_bit(cls, tmp_path):
    ref_params, nvme_params = _params(), _params()
    ref = cls(ref_params, lr=1e-2, weight_decay=0.1)
    opt = cls(
        nvme_params, lr=1e-2, weight_decay=0.1, nvme_offload_fraction=1.0, nvme_offload_dir=str(tmp_path)
    )
    _run(ref, ref_params)
    _run(opt, nvme_params)
    for a, b in zip(ref_params, nvme_params, strict=True):
        assert torch.equal(a, b)
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(ref.state[a][key], opt.state[b][key])
            assert _is_file_backed(opt.state[b][key], str(tmp_path)), key
    opt.close()


def test_fraction_picks_the_largest_tensors_within_the_budget(tmp_path):
    params = _params((1000, 600, 300, 100))  # 2000 elements; half = 1000
    opt = CPUAdam(params, nvme_offload_fraction=0.5, nvme_offload_dir=tmp_path)
    _run(opt, params, steps=1)
    backed = [_is_file_backed(opt.state[p]["exp_avg"], str(tmp_path)) for p in params]
    assert backed == [True, False, False, False]
    opt2 = CPUAdam(params, nvme_offload_fraction=0.7)
    _run(opt2, params, steps=1)  # 1400: the 1000 fits, the 600 does not, the 300 does, the 100 does too
    backed = [_is_file_backed(opt2.state[p]["exp_avg"], opt2.nvme_offload_dir) for p in params]
    assert backed == [True, False, True, True]
    opt.close()
    opt2.close()


def test_master_weights_are_offloaded_too(tmp_path):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5000).bfloat16())]
    ref_params = [torch.nn.Parameter(params[0].detach().clone())]
    opt = CPUAdam(params, master_weights=True, nvme_offload_fraction=1.0, nvme_offload_dir=tmp_path)
    ref = CPUAdam(ref_params, master_weights=True)
    _run(opt, params)
    _run(ref, ref_params)
    assert _is_file_backed(opt.state[params[0]]["master_param"], str(tmp_path))
    assert torch.equal(params[0], ref_params[0])
    assert torch.equal(opt.state[params[0]]["master_param"], ref.state[ref_params[0]]["master_param"])
    opt.close()


# Measured in a fresh interpreter per mode: in a process that already freed large tensors, malloc hands back
# resident pages and RssAnon would not grow for the in-memory state either.
_RSS_SCRIPT = r"""
import sys, torch
from stepforge.fused import CPUAdam

def kb(*keys):
    with open("/proc/self/status") as f:
        return sum(int(l.split()[1]) for l in f if l.split(":")[0] in keys)

n = 4_000_000
p = torch.nn.Parameter(torch.randn(n))
p.grad = torch.randn(n)
fraction, directory = float(sys.argv[1]), sys.argv[2]
opt = CPUAdam([p], nvme_offload_fraction=fraction, nvme_offload_dir=directory if fraction else None)
# the state is created by the first step: measure from after construction (which allocates on its own)
anon, files = kb("RssAnon"), kb("RssFile", "RssShmem")  # RssShmem: a temp dir on tmpfs
opt.step()
opt.step()
print(kb("RssAnon") - anon, kb("RssFile", "RssShmem") - files, opt._nvme.file_bytes() if opt._nvme else 0)
opt.close()
"""


def _measure(fraction: float, directory: str) -> tuple[int, int, int]:
    out = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, str(fraction), directory],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    anon, files, nbytes = (int(x) for x in out.stdout.split())
    return anon, files, nbytes


def test_resident_anonymous_memory_is_lower_by_the_offloaded_state(tmp_path):
    """RssAnon (the process's own memory, which only swap can take away) grows by the 2 x 4 bytes of state per
    element in memory, and by almost nothing with the state in files; the state then shows up as file pages
    (which the kernel writes back and evicts) and as bytes in the files."""
    if os.environ.get("STEPFORGE_EXPECT_ASAN"):
        pytest.skip(
            "under nox -s asan the ASan allocator and shadow memory change RssAnon (measured in tests(fused))"
        )
    n = 4_000_000
    state_kb = 2 * n * 4 // 1024  # 31 250 KiB of exp_avg + exp_avg_sq
    anon_mem, _, _ = _measure(0.0, str(tmp_path))
    anon_file, file_pages, file_bytes = _measure(1.0, str(tmp_path))
    assert anon_mem > 0.9 * state_kb, (anon_mem, state_kb)
    assert anon_mem - anon_file > 0.85 * state_kb, (anon_mem, anon_file, state_kb)
    assert anon_file < 0.25 * state_kb, (anon_file, state_kb)  # step-time temporaries, thread pools
    assert file_pages > 0.9 * state_kb, (file_pages, state_kb)
    assert file_bytes == 2 * n * 4


def test_files_are_removed_on_close_and_on_garbage_collection(tmp_path):
    params = _params()
    opt = CPUAdam(params, nvme_offload_fraction=1.0, nvme_offload_dir=tmp_path)
    _run(opt, params, steps=1)
    path = opt.nvme_offload_dir
    assert os.path.dirname(path) == str(tmp_path) and len(os.listdir(path)) == 2 * len(params)
    opt.close()
    assert not os.path.exists(path)
    assert list(tmp_path.iterdir()) == []  # the user's directory itself stays

    opt = CPUAdam(params, nvme_offload_fraction=0.5)  # temp dir
    _run(opt, params, steps=1)
    path = opt.nvme_offload_dir
    assert os.path.isdir(path)
    del opt
    gc.collect()
    assert not os.path.exists(path)


def test_state_dict_round_trip_with_torch_and_into_files(tmp_path):
    params = _params()
    opt = CPUAdam(params, lr=1e-2, nvme_offload_fraction=1.0, nvme_offload_dir=tmp_path)
    _run(opt, params, steps=2)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    # into an in-memory torch AdamW and into a fresh offloaded CPUAdam: both continue identically
    torch_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    nvme_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    buf.seek(0)
    saved = torch.load(buf)
    ref = torch.optim.AdamW(torch_params, lr=1e-2, fused=True)
    ref.load_state_dict(copy.deepcopy(saved))  # torch keeps the tensors it is given (steps included)
    other_dir = tmp_path / "other"
    other_dir.mkdir()
    opt2 = CPUAdam(nvme_params, lr=1e-2, nvme_offload_fraction=1.0, nvme_offload_dir=other_dir)
    opt2.load_state_dict(saved)
    for p in nvme_params:
        assert _is_file_backed(opt2.state[p]["exp_avg"], str(other_dir))
    _run(ref, torch_params, steps=2, seed=5)
    _run(opt2, nvme_params, steps=2, seed=5)
    _run(opt, params, steps=2, seed=5)
    for a, b, c in zip(torch_params, nvme_params, params, strict=True):
        assert torch.equal(a, b) and torch.equal(b, c)
    opt.close()
    opt2.close()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(nvme_offload_fraction=1.5), r"nvme_offload_fraction must be in \[0, 1\]"),
        (dict(nvme_offload_fraction=-0.1), r"nvme_offload_fraction must be in \[0, 1\]"),
        (dict(nvme_offload_fraction=float("nan")), r"nvme_offload_fraction must be in \[0, 1\]"),
        (dict(nvme_offload_fraction="0.5"), "nvme_offload_fraction must be a number"),
        (dict(nvme_offload_fraction=True), "nvme_offload_fraction must be a number"),
        (
            dict(nvme_offload_fraction=0.5, nvme_offload_dir="/nonexistent/stepforge"),
            "not an existing directory",
        ),
        (dict(nvme_offload_fraction=0.5, nvme_offload_dir=3), "nvme_offload_dir must be a path"),
    ],
    ids=["above-one", "negative", "nan", "string", "bool", "missing-dir", "not-a-path"],
)
@pytest.mark.parametrize("cls", [CPUAdam, HybridAdam])
def test_bad_offload_arguments_are_refused_naming_the_parameter(cls, kwargs, match):
    with pytest.raises(HyperParameterError, match=match):
        cls(_params(), **kwargs)


def test_a_directory_without_write_permission_is_refused(tmp_path, monkeypatch):
    # os.access is what the check asks (root may write anywhere, so a chmod-ed directory cannot show it here)
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(HyperParameterError, match="nvme_offload_dir=.* is not writable"):
        CPUAdam(_params(), nvme_offload_fraction=0.5, nvme_offload_dir=tmp_path)


def test_colossalai_positional_signature():
    params = _params()
    opt = CPUAdam(params, 1e-3, True, (0.9, 0.999), 1e-8, 0.0, True, 0.25, None)
    assert opt.nvme_offload_fraction == 0.25 and opt.nvme_offload_dir is not None
    opt.close()
    assert CPUAdam(params).nvme_offload_dir is None
