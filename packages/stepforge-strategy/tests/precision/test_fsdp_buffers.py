# SPDX-License-Identifier: Apache-2.0
"""FSDP2 plugins cast floating buffers to the compute dtype, as ColossalAI does.

A BatchNorm model under ``torch_fsdp`` with bf16, or ``gemini`` with fp16, used to crash in the forward (the
parameters were cast by FSDP2's ``MixedPrecisionPolicy``, the running statistics stayed fp32). 2 gloo ranks, one
spawn, bounded by its timeout. Reference: the same plugin in fp32 on the same data in the same process.
Tolerances: 3 SGD steps (lr 0.1) in bf16 stay within 5e-2 of fp32 (bf16 has 8 mantissa bits); fp16 within 1e-2.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stepforge.strategy import Booster
from stepforge.testing.distributed import requires_gloo, run_distributed

STEPS = 3


class _BatchNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.fc(x))))


def _train(plugin: dict, rank: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.dtype]]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    booster = Booster(plugin=plugin)
    model = _BatchNormNet()
    model, opt, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)
        opt.zero_grad()
        booster.backward(F.mse_loss(model(x).float(), y), opt)
        opt.step()
    dtypes = {name: b.dtype for name, b in model.unwrap().named_buffers() if b.is_floating_point()}
    full = get_model_state_dict(
        model.unwrap(), options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    return {k: v.detach().float().clone() for k, v in full.items()}, dtypes


def _cases(rank: int, world: int) -> dict:
    return {
        "fsdp_fp32": _train(dict(type="torch_fsdp", precision="fp32"), rank),
        "fsdp_bf16": _train(dict(type="torch_fsdp", precision="bf16"), rank),
        "gemini_fp32": _train(dict(type="gemini", precision="fp32", placement_policy="auto"), rank),
        "gemini_fp16": _train(
            dict(type="gemini", precision="fp16", placement_policy="auto", initial_scale=2**8), rank
        ),  # ColossalAI's 2**32 would skip the first steps
    }


@requires_gloo
def test_batchnorm_trains_under_fsdp_bf16_and_gemini_fp16():
    out = run_distributed(_cases, 2, timeout=180)[0]
    for case, ref, dtype, bound in (
        ("fsdp_bf16", "fsdp_fp32", torch.bfloat16, 5e-2),
        ("gemini_fp16", "gemini_fp32", torch.float16, 1e-2),
    ):
        state, dtypes = out[case]
        assert dtypes["bn.running_mean"] == dtype and dtypes["bn.running_var"] == dtype, (case, dtypes)
        expected, _ = out[ref]
        assert set(state) == set(expected)
        worst = max((state[k] - v).abs().max().item() for k, v in expected.items())
        assert 0 < worst <= bound, (case, worst)  # low precision really ran, and tracked fp32
        assert not torch.equal(expected["bn.running_mean"], torch.zeros(8))  # the statistics were updated
