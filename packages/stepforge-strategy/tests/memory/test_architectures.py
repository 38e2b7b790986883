# SPDX-License-Identifier: Apache-2.0
"""The estimate on transformers models it was not tuned on: GPT-2 (tied head), BERT (masked LM, padded attention
mask) and Mixtral (mixture of experts: routing reads values) trained as rank 0 of 2 on the fake process group,
every buffer really allocated, torch's ``MemTracker`` peak against the estimate's (the whole benchmark, at 1, 2
and 4 gloo ranks over seven architectures and every plugin: ``tools/bench/estimate/bench_architectures.py``)."""

from __future__ import annotations

import _architecture_cases as cases
import pytest

from stepforge.testing.fake_world import run_isolated

pytest.importorskip("transformers")

CASES = [
    ("gpt2", "torch_fsdp", "fp32", False),
    ("gpt2", "gemini", "bf16", False),
    ("gpt2", "zero2", "bf16", False),
    ("gpt2", "torch_fsdp", "fp32", True),
    ("bert", "torch_fsdp", "fp32", False),
    ("bert", "zero2", "bf16", True),
    ("mixtral", "torch_fsdp", "fp32", False),
    ("mixtral", "gemini", "bf16", False),
]
#: FSDP2 without checkpointing on fake-traced or real-traced activations: every gathered unit, all-gather and
#: reduce-scatter buffer is placed where it lives, so the peak is met to the byte (1% slack)
EXACT = {
    ("gpt2", "torch_fsdp", "fp32", False),
    ("gpt2", "gemini", "bf16", False),
    ("bert", "torch_fsdp", "fp32", False),
    ("mixtral", "torch_fsdp", "fp32", False),
}


def test_peak_and_held_of_transformers_models_under_sharding() -> None:
    """Every case's estimated peak within 8% of the measured one (:data:`EXACT`'s within 1%: the prefetched
    unit's all-gather output at the head's backward, the root's gradients freed before its reduce-scatter output)
    and its held total within 1% (FSDP2 units gathered and freed in turn, ZeRO's pieces built as backward runs,
    checkpointed blocks recomputed); Mixtral in fp32
    meets an op without a fake kernel (``grouped_mm``) and is traced on real tensors, the others on fake ones."""
    results = run_isolated(cases.measured_and_estimated, CASES, timeout=600)
    for r in results:
        assert abs(r["est_held"] / r["held"] - 1) <= 0.01, r
        assert abs(r["est_peak"] / r["peak"] - 1) <= (0.01 if r["case"] in EXACT else 0.08), r
    methods = {r["case"]: r["trace"] for r in results}
    assert methods[("mixtral", "torch_fsdp", "fp32", False)] == "real"
    assert methods[("gpt2", "torch_fsdp", "fp32", False)] == "fake"
