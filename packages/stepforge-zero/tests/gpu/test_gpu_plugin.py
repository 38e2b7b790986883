# SPDX-License-Identifier: Apache-2.0
"""``LowLevelZeroPlugin`` on CUDA, 1 NCCL rank: ``prepare`` places and casts a model on the GPU, the wrapped
model casts CPU-made float inputs to the working dtype, ``backward``/``step`` train it, and the checkpoint pair
(``get_state_dict``/``set_state_dict``) continues bitwise. (Through the Booster and ``Strategy``: the ``zero2``
cases of stepforge-strategy's ``tests/gpu``.)

Measure: ||plugin - reference|| / ||reference - start|| over the parameters after ``STEPS`` AdamW steps (lr 1e-2)
against a plain fp32 torch loop on the GPU; a step that does nothing scores 1.0. Bound 0.1 for bf16/fp16 (the
same runs on the CPU stay below 0.02), and above 0 (the half precision really ran); fp16 steps none skipped.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stepforge.testing.gpu import relative_error, run_on_one_gpu
from stepforge.testing.models import block_net

pytestmark = pytest.mark.gpu

STEPS, ROWS, LR, WD = 6, 16, 1e-2, 0.01
CASES = [(1, "bf16", False), (2, "bf16", True), (1, "fp16", True), (2, "fp16", False)]
BOUND = 0.1


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    x = torch.randn(ROWS, 6, generator=g)
    return x, torch.sin(x.sum(dim=1, keepdim=True))


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu().clone() for k, v in module.state_dict().items()}


def _copy(tree: object) -> object:
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _copy(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_copy(v) for v in tree)
    return tree


def _reference(device: str) -> dict[str, torch.Tensor]:
    model = block_net(0).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        F.mse_loss(model(x.to(device)), y.to(device)).backward()
        opt.step()
    return _state(model)


def _prepared(stage: int, precision: str, offload: bool) -> tuple:
    from stepforge.zero import LowLevelZeroPlugin

    plugin = LowLevelZeroPlugin(stage=stage, precision=precision, cpu_offload=offload, initial_scale=2**16)
    model = block_net(0)
    return plugin, *plugin.prepare(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD))


def _train(plugin, model, opt, device: torch.device, first: int, stop: int) -> None:  # type: ignore[no-untyped-def]
    for step in range(first, stop):
        x, y = _batch(step)
        # inputs made on the CPU in fp32: moved here, cast to the working dtype by the wrapped model
        loss = F.mse_loss(model(x.to(device)).float(), y.to(device))
        plugin.backward(loss, opt)
        opt.step()
        opt.zero_grad()


def _run(stage: int, precision: str, offload: bool) -> dict:
    plugin, model, opt = _prepared(stage, precision, offload)
    device = plugin.device
    params = list(model.unwrap().parameters())
    out: dict = dict(
        device=device.type,
        dtypes=sorted({str(p.dtype) for p in params}),
        param_devices=sorted({p.device.type for p in params}),
        master_devices=sorted({p.device.type for g in opt.unwrap().param_groups for p in g["params"]}),
    )
    half = STEPS // 2
    _train(plugin, model, opt, device, 0, half)
    msd, osd = plugin.get_state_dict(model, opt)
    saved = (_copy(msd), _copy(osd))  # the pair holds live tensors: the steps below would change them
    _train(plugin, model, opt, device, half, STEPS)
    out["state"] = _state(model.unwrap())
    out["skipped"] = opt.skipped_steps
    # a second prepared model takes the saved pair and the same remaining steps
    plugin2, model2, opt2 = _prepared(stage, precision, offload)
    plugin2.set_state_dict(model2, opt2, *saved)
    _train(plugin2, model2, opt2, device, half, STEPS)
    out["resumed"] = _state(model2.unwrap())
    return out


def _all(rank: int, world: int, device: str) -> dict:
    return {"reference": _reference(device), "runs": {case: _run(*case) for case in CASES}}


@pytest.fixture(scope="module")
def results() -> dict:
    return run_on_one_gpu(_all, "cuda", timeout=300)


@pytest.mark.parametrize("case", CASES, ids=[f"stage{s}-{p}-offload{o}" for s, p, o in CASES])
def test_plugin_trains_on_cuda_like_fp32_torch(results: dict, case: tuple) -> None:
    _stage, precision, offload = case
    out = results["runs"][case]
    assert out["device"] == "cuda" and out["param_devices"] == ["cuda"]
    assert out["dtypes"] == [str({"bf16": torch.bfloat16, "fp16": torch.float16}[precision])]
    assert out["master_devices"] == (["cpu"] if offload else ["cuda"])
    assert out["skipped"] == 0
    start = _state(block_net(0))
    err = relative_error(out["state"], results["reference"], start)
    assert 0 < err < BOUND, (case, err)


@pytest.mark.parametrize("case", CASES, ids=[f"stage{s}-{p}-offload{o}" for s, p, o in CASES])
def test_checkpoint_pair_continues_bitwise(results: dict, case: tuple) -> None:
    out = results["runs"][case]
    for key, value in out["state"].items():
        assert torch.equal(out["resumed"][key], value), (case, key)
