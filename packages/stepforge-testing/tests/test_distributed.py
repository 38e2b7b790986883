# SPDX-License-Identifier: Apache-2.0
"""The gloo launcher: results by rank, errors naming the rank, timeouts instead of hangs, one thread each."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from stepforge.testing.distributed import (
    DistributedTestError,
    DistributedTimeoutError,
    free_port,
    requires_gloo,
    run_distributed,
)

pytestmark = [pytest.mark.distributed, requires_gloo]


def _sum_ranks(rank: int, world_size: int, scale: float) -> dict:
    t = torch.tensor([float(rank) * scale])
    dist.all_reduce(t)
    return {
        "rank": rank,
        "world": dist.get_world_size(),
        "backend": dist.get_backend(),
        "sum": t.item(),
        "threads": torch.get_num_threads(),
        "omp": os.environ.get("OMP_NUM_THREADS"),
        "extra": os.environ.get("STEPFORGE_TEST_EXTRA"),
        "tensor": torch.arange(3) + rank,
    }


def _raise_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise RuntimeError("boom from the test body")
    dist.barrier()  # rank 0 blocks here; the launcher must kill it


def _deadlock(rank: int, world_size: int) -> None:
    # both ranks wait for a message the other never sends
    dist.recv(torch.zeros(1), src=1 - rank)


def test_results_by_rank_threads_and_env() -> None:
    out = run_distributed(_sum_ranks, 3, 2.0, env={"STEPFORGE_TEST_EXTRA": "yes"})
    assert [o["rank"] for o in out] == [0, 1, 2]
    for o in out:
        assert o["world"] == 3
        assert o["backend"] == "gloo"
        assert o["sum"] == 6.0  # (0 + 1 + 2) * 2
        assert o["threads"] == 1
        assert o["omp"] == "1"
        assert o["extra"] == "yes"
    assert torch.equal(out[2]["tensor"], torch.tensor([2, 3, 4]))
    # the parent's environment is restored
    assert os.environ.get("STEPFORGE_TEST_EXTRA") is None


def test_exception_names_rank_and_traceback() -> None:
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_raise_on_rank_1, 2, timeout=60)
    assert info.value.rank == 1
    text = str(info.value)
    assert "rank 1 of 2" in text
    assert "boom from the test body" in text
    assert "_raise_on_rank_1" in text


def test_hung_collective_times_out() -> None:
    with pytest.raises(
        DistributedTimeoutError, match=r"did not finish within 4 s; ranks still running: \[0, 1\]"
    ):
        run_distributed(_deadlock, 2, timeout=4)


def test_argument_validation_and_free_port() -> None:
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        run_distributed(_sum_ranks, 0)
    with pytest.raises(ValueError, match="timeout must be > 0"):
        run_distributed(_sum_ranks, 1, timeout=0)
    assert 0 < free_port() < 65536
