# SPDX-License-Identifier: Apache-2.0
"""``relative_error`` (the measure the GPU tests bound) and ``run_on_one_gpu`` (tried on gloo here)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from stepforge.testing.distributed import requires_gloo
from stepforge.testing.gpu import relative_error, run_on_one_gpu


def test_relative_error_scores_a_do_nothing_step_one_and_an_exact_one_zero() -> None:
    start = {"w": torch.zeros(3), "b": torch.zeros(1)}
    expected = {"w": torch.tensor([3.0, 0.0, 0.0]), "b": torch.tensor([4.0])}  # moved by 5
    assert relative_error(start, expected, start) == 1.0
    assert relative_error(expected, expected, start) == 0.0
    half = {"w": torch.tensor([1.5, 0.0, 0.0], dtype=torch.bfloat16), "b": torch.tensor([2.0])}
    assert relative_error(half, expected, start) == pytest.approx(0.5)


def test_relative_error_refuses_meaningless_comparisons() -> None:
    start = {"w": torch.zeros(2)}
    with pytest.raises(ValueError, match="names differ"):
        relative_error({"v": torch.zeros(2)}, start, start)
    with pytest.raises(ValueError, match="did not move"):
        relative_error(start, start, start)


def _facts(rank: int, world: int, scale: float) -> dict:
    t = torch.full((2,), scale)
    dist.all_reduce(t)
    return dict(rank=rank, world=world, backend=dist.get_backend(), sum=t.sum().item(),
                ifname=os.environ.get("NCCL_SOCKET_IFNAME"))  # fmt: skip


@requires_gloo
def test_run_on_one_gpu_runs_one_rank_with_a_group() -> None:
    out = run_on_one_gpu(_facts, 1.5, backend="gloo", timeout=120)
    assert out == dict(
        rank=0, world=1, backend="gloo", sum=3.0, ifname=os.environ.get("NCCL_SOCKET_IFNAME", "lo")
    )
