# SPDX-License-Identifier: Apache-2.0
"""``Strategy`` on CUDA, 1 NCCL rank: plugins ``torch_ddp``, ``torch_fsdp``, ``gemini`` (auto: offloaded, and
static: on the device), ``zero2`` and ``zero2`` with CPU offload, each in fp32, bf16 and fp16 (``_gpu_cases``), against a plain fp32 torch loop on the same device.

Measure: ``relative_error`` = ||strategy - reference|| / ||reference - start|| over all parameters after
``STEPS`` AdamW steps (lr 1e-2) of ``accumulative_counts=2`` windows; a step that does nothing scores 1.0.
Bounds: fp32 below 1e-3 (only the reduction order and, for ZeRO, flattened masters differ); bf16/fp16 below 0.1
(0.015 at most when the same runs were tried on the CPU) and above 0 (the half precision really ran). No fp16 step may be skipped, or the comparison would measure the
loss scaler instead. Checkpoints: a save after half the steps, resumed by a new Strategy on cuda (default
``map_location``: the plugin's device), loads the saved weights bitwise and continues bitwise like the
uninterrupted run.
"""

from __future__ import annotations

import pytest
import torch
from _gpu_cases import (
    PLACEMENT,
    PLUGINS,
    PRECISIONS,
    amp_wrapper_run,
    reference,
    resume_run,
    start_state,
    strategy_run,
)

from stepforge.testing.gpu import relative_error, run_on_one_gpu

pytestmark = pytest.mark.gpu

CASES = [(name, precision) for name in PLUGINS for precision in PRECISIONS]
RESUME = [(name, "bf16") for name in PLUGINS] + [("zero2", "fp16"), ("torch_ddp", "fp16")]
FP32_BOUND, HALF_BOUND = 1e-3, 0.1


def _all(rank: int, world: int, device: str, root: str) -> dict:
    out: dict = {"reference": reference(device), "amp": amp_wrapper_run(device)}
    out["runs"] = {case: strategy_run(f"{root}/run_{case[0]}_{case[1]}", *case) for case in CASES}
    out["resume"] = {case: resume_run(f"{root}/resume_{case[0]}_{case[1]}", *case) for case in RESUME}
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run_on_one_gpu(_all, "cuda", str(tmp_path_factory.mktemp("strategy_gpu")), timeout=500)


@pytest.mark.parametrize("case", CASES, ids=[f"{n}-{p}" for n, p in CASES])
def test_plugin_tracks_the_fp32_torch_loop(results: dict, case: tuple[str, str]) -> None:
    name, precision = case
    out = results["runs"][case]
    assert out["backend"] == "nccl" and out["device"] == "cuda"
    assert (out["param_devices"], out["master_devices"]) == tuple([d] for d in PLACEMENT[name]), case
    assert out["skipped"] == 0, f"{case}: {out['skipped']} fp16 steps skipped"
    err = relative_error(out["state"], results["reference"], start_state())
    if precision == "fp32":
        assert err < FP32_BOUND, (case, err)
    else:
        assert 0 < err < HALF_BOUND, (case, err)


@pytest.mark.parametrize("case", RESUME, ids=[f"{n}-{p}" for n, p in RESUME])
def test_checkpoint_resumes_bitwise_on_cuda(results: dict, case: tuple[str, str]) -> None:
    out = results["resume"][case]
    assert any(not torch.equal(out["saved"][k], out["expected"][k]) for k in out["saved"])  # training moved
    for key, value in out["saved"].items():
        assert torch.equal(out["loaded"][key], value), (case, key, "load")
    for key, value in out["expected"].items():
        assert torch.equal(out["got"][key], value), (case, key, "continue")


def test_amp_optim_wrapper_uses_the_cuda_grad_scaler(results: dict) -> None:
    amp = results["amp"]
    assert amp["scaler"] == "GradScaler" and amp["enabled"]
    assert amp["scales"] == [2.0**16] * len(amp["scales"])  # no overflow, no growth within 2000 steps
    err = relative_error(amp["state"], results["reference"], start_state())
    assert 0 < err < HALF_BOUND, err
