# SPDX-License-Identifier: Apache-2.0
"""The one-GPU benches' arithmetic, checked against independent counts: the GPT's parameter formula against the
module built on the meta device (GPT-2 small's 124 M), the dense bf16 peak picked by device name (the PCIe and NVL
parts before their SXM namesakes), MFU and ColossalAI's 8P figure, the offload split's hidden CPU time, the CPU
Adam bench's GPT layout, and the CPU ZeRO bench's per-rank core pinning checks."""

from __future__ import annotations

import argparse

import pytest
import torch

from bench.fused.bench_cpuadam_scale import gpt_layout
from bench.gpu_train._flops import colossalai_tflops, mfu, model_tflops, peak_bf16_tflops
from bench.gpu_train._gpt import GPT, SHAPES, build_lazy, capacity_shape
from bench.gpu_train.bench_offload import split_step
from bench.train import bench_train


@pytest.mark.parametrize("name", ["gpt2-124m", "gpt-1.3b", "tiny"])
def test_the_parameter_formula_counts_the_module_built_on_meta(name: str) -> None:
    with torch.device("meta"):
        model = GPT(SHAPES[name])
    assert sum(p.numel() for p in model.parameters()) == SHAPES[name].parameters  # tied head counted once
    assert model.head.weight is model.tok.weight


def test_the_lazy_gpt_allocates_nothing_until_materialised_then_has_the_gpt2_init() -> None:
    from stepforge.strategy import LazyInitContext

    shape = capacity_shape(2, d_model=64, heads=4, vocab=256, seq_len=16)
    model = build_lazy(shape, "cpu", torch.bfloat16, seed=1)
    assert all(p.is_meta for p in model.parameters())
    LazyInitContext.materialize(model)
    again = LazyInitContext.materialize(build_lazy(shape, "cpu", torch.bfloat16, seed=1))
    assert model.head.weight is model.tok.weight
    for (name, p), (_, q) in zip(model.named_parameters(), again.named_parameters(), strict=True):
        assert p.dtype == torch.bfloat16 and torch.equal(p, q), name  # the seed fixes every value
    block = model.blocks[0]
    assert torch.all(block.ln1.weight == 1) and torch.all(block.qkv.bias == 0)
    # normal 0.02, residual projections 0.02 / sqrt(2 L) = 0.01 (torch's default Linear init would give 0.072)
    assert float(model.tok.weight.detach().float().std()) == pytest.approx(0.02, rel=0.05)
    assert float(block.proj.weight.detach().float().std()) == pytest.approx(0.01, rel=0.05)


def test_the_named_shapes_have_their_published_sizes() -> None:
    assert 124.0e6 < SHAPES["gpt2-124m"].parameters < 124.6e6  # GPT-2 small, vocabulary padded to 50 304
    assert 1.30e9 < SHAPES["gpt-1.3b"].parameters < 1.32e9  # GPT-3 XL's shape, tied head
    per_block = capacity_shape(2).parameters - capacity_shape(1).parameters
    assert per_block == 12 * 4096**2 + 13 * 4096


@pytest.mark.parametrize(
    ("device_name", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", 989.4),
        ("NVIDIA H100 PCIe", 756.5),
        ("NVIDIA H100 NVL", 835.5),
        ("NVIDIA H200", 989.4),
        ("NVIDIA H200 NVL", 835.5),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("Tesla V100-SXM2-32GB", None),
        (None, None),
    ],
)
def test_the_peak_is_looked_up_by_device_name(device_name: str | None, tflops: float | None) -> None:
    assert peak_bf16_tflops(device_name)[0] == tflops


def test_mfu_and_colossalai_tflops() -> None:
    shape = SHAPES["gpt2-124m"]
    tokens_per_s = 1e6
    expected = (6 * shape.parameters + 12 * 12 * 768 * 1024) * 1e6 / 1e12
    assert model_tflops(tokens_per_s, shape.flops_per_token) == pytest.approx(expected)
    assert mfu(tokens_per_s, shape.flops_per_token, 989.4) == pytest.approx(expected / 989.4)
    assert mfu(tokens_per_s, shape.flops_per_token, None) is None
    assert colossalai_tflops(tokens_per_s, shape.parameters) == pytest.approx(8 * shape.parameters / 1e6)


def _totals(host: float, device: float) -> dict[str, dict[str, float]]:
    return {
        "inner_step": {"host_ms": host, "device_ms": device, "count": 1},
        "forward": {"host_ms": 5.0, "device_ms": 9.0, "count": 1},
        "optimizer_step": {"host_ms": 120.0, "device_ms": 50.0, "count": 1},
    }


def test_the_hidden_cpu_step_is_host_time_the_device_timeline_did_not_spend_waiting() -> None:
    # the device was idle for the whole CPU step (its two events fired as recorded): nothing hidden
    assert split_step([_totals(100.0, 100.0)], [200.0])["hidden_cpu_ms"] == 0.0
    # the device was still busy for 70 ms of the CPU step's 100: 70 ms hidden; medians over steps
    split = split_step(
        [_totals(100.0, 30.0), _totals(100.0, 40.0), _totals(100.0, 20.0)], [150.0, 160.0, 170.0]
    )
    assert split["hidden_cpu_ms"] == 70.0
    assert split["hidden_cpu_fraction"] == pytest.approx(0.7)
    assert split["step_ms"] == 160.0 and split["forward_ms"] == 9.0 and split["forward_host_ms"] == 5.0
    assert split["optimizer_step_ms"] == 50.0  # the optimizer's own span, apart from the whole step


def test_the_gpt_layout_holds_exactly_numel_elements_in_block_shapes() -> None:
    sizes = gpt_layout(10_000, 16)
    assert sum(sizes) == 10_000 and min(sizes) > 0
    assert sizes[:4] == [16, 16, 3 * 16 * 16, 3 * 16]  # LayerNorm weight and bias, QKV weight and bias
    assert gpt_layout(7, 16) == [7]


def test_cores_per_rank_is_checked_against_the_usable_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench_train.os, "sched_getaffinity", lambda pid: set(range(16)))

    def resolved(**kw: int) -> int:
        args = argparse.Namespace(world=2, threads=0, cores_per_rank=0)
        vars(args).update(kw)
        bench_train.resolve_threads(args)
        return int(args.threads)

    assert resolved() == 8  # no pinning: the cores shared out
    assert resolved(cores_per_rank=8) == 8
    assert resolved(cores_per_rank=8, threads=6) == 6  # two cores per rank left to gloo
    with pytest.raises(SystemExit, match="at most 8"):
        resolved(cores_per_rank=9)
    with pytest.raises(SystemExit, match="oversubscribes"):
        resolved(cores_per_rank=4, threads=6)
