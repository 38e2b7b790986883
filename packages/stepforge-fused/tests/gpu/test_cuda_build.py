# SPDX-License-Identifier: Apache-2.0
"""The ``_cuda`` module as built: imports without a GPU, reports why it cannot run, validates its arguments.

These tests need no device. They skip when the package was built without CUDA, unless
``STEPFORGE_EXPECT_CUDA_BUILD=1`` (the ``build_cuda`` nox session), where a missing module is a failure.
"""

from __future__ import annotations

import array
import os
import re

import pytest

from stepforge.fused import _backend

EXPECT_BUILD = os.environ.get("STEPFORGE_EXPECT_CUDA_BUILD", "") == "1"


@pytest.fixture(scope="module")
def mod():
    module = _backend._load("_cuda")[0]
    if module is None:
        if EXPECT_BUILD:
            pytest.fail(f"STEPFORGE_EXPECT_CUDA_BUILD=1 but: {_backend.cuda_status()}")
        pytest.skip(f"not built with CUDA: {_backend.cuda_status()}")
    return module


def _args_adam(n_ptrs, n_sizes, dtype=0):
    return dict(
        params=[0] * n_ptrs,
        grads=[0] * n_ptrs,
        exp_avgs=[0] * n_ptrs,
        exp_avg_sqs=[0] * n_ptrs,
        masters=None,
        sizes=[8] * n_sizes,
        steps=[1] * n_sizes,
        param_dtype=dtype,
        grad_dtype=0,
        lr=1e-3,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.0,
        adamw_mode=True,
        bias_correction=True,
        grad_divisor=1.0,
        found_inf_ptr=0,
        check_finite=False,
        ctx=0,
    )


def test_contract_surface(mod):
    for name in ("adam", "sgd", "lamb", "l2norm", "scale", "device_count", "runtime_version", "built_archs"):
        assert callable(getattr(mod, name)), name
    assert (mod.DTYPE_FLOAT32, mod.DTYPE_FLOAT16, mod.DTYPE_BFLOAT16) == (0, 1, 2)
    assert mod.runtime_version() >= 12000


def test_status_names_built_architectures(mod):
    archs = mod.built_archs()
    assert archs, "no CUDA architecture recorded"
    status = _backend.cuda_status()
    for arch in archs:
        sm, _, kind = arch.partition("-")
        assert f"sm_{sm} ({'PTX' if kind == 'virtual' else 'cubin'})" in status, status
    assert "(static runtime)" in status
    if not os.environ.get("STEPFORGE_CUDA_ARCHS"):
        # The default build: cubins for Ampere and Hopper, PTX for newer GPUs.
        assert archs == ["80-real", "90-real", "90-virtual"]


def test_without_device_says_why(mod):
    if mod.available():
        pytest.skip("a CUDA device is present")
    status = _backend.cuda_status()
    assert re.search(r"no CUDA (driver/device|device visible)", status), status
    with pytest.raises(RuntimeError, match=r"cuda(Error\w+|GetDeviceCount)"):
        mod.device_count()
    with pytest.raises(_backend.BackendUnavailableError, match="no CUDA device"):
        _backend.cuda_module()
    assert not _backend.cuda_available()


def test_launch_without_device_raises_not_crashes(mod):
    if mod.available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(RuntimeError, match="driver|device"):
        mod.adam(
            **_args_adam(1, 1)
            | {"params": [4096], "grads": [8192], "exp_avgs": [12288], "exp_avg_sqs": [16384]}
        )


def test_list_length_mismatch_is_value_error(mod):
    with pytest.raises(ValueError, match="grads has 2 entries but sizes has 3"):
        mod.adam(**_args_adam(2, 3) | {"params": [0, 0, 0]})


def test_bad_dtype_code(mod):
    with pytest.raises(ValueError, match="param_dtype must be 0"):
        mod.adam(**_args_adam(1, 1, dtype=7))


def test_int64_buffers_accepted_and_checked(mod):
    # array('q') is parsed (the length mismatch proves it was read); array('i') is rejected with the format.
    with pytest.raises(ValueError, match="has 1 entries but sizes has 2"):
        mod.adam(**_args_adam(1, 2) | {"params": array.array("q", [0, 0]), "sizes": array.array("q", [1, 1])})
    with pytest.raises(ValueError, match="int64"):
        mod.adam(**_args_adam(1, 1) | {"sizes": array.array("i", [1])})


def test_masters_need_low_precision_params(mod):
    with pytest.raises(ValueError, match="masters"):
        mod.adam(**_args_adam(1, 1) | {"masters": [0]})


def test_dtype_code_helper():
    import torch

    codes = [
        _backend.dtype_code(d, what="x", owner="t") for d in (torch.float32, torch.float16, torch.bfloat16)
    ]
    assert codes == [0, 1, 2]
    with pytest.raises(TypeError, match="float64"):
        _backend.dtype_code(torch.float64, what="x", owner="t")
