# SPDX-License-Identifier: Apache-2.0
"""Collectives counted by wrapping ``torch.distributed``, and per-rank memory of the sharded optimizer.

Counting model: 6 parameters of 40 elements at 2 ranks (no padding), ``reduce_bucket_size=80`` elements, so a
bucket closes after every 2 parameters: ceil(240 / 80) = 3 buckets per synchronised backward.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn

from stepforge.core import no_sync
from stepforge.testing.distributed import requires_gloo, run_distributed
from stepforge.testing.zero_cases import counting
from stepforge.zero.low_level import LowLevelZeroOptimizer

pytestmark = [pytest.mark.distributed, requires_gloo]

NPARAMS, NUMEL, BUCKET = 6, 40, 80
BUCKETS = -(-NPARAMS * NUMEL // BUCKET)  # 3


class _Flat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.ps = nn.ParameterList([nn.Parameter(torch.randn(NUMEL)) for _ in range(NPARAMS)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum((p * x).sum() for p in self.ps)


def _one_step(opt: LowLevelZeroOptimizer, model: nn.Module, k: int, use_no_sync: bool) -> Counter:
    with counting() as calls:
        for micro in range(k):
            x = torch.full((NUMEL,), float(micro + 1))
            if use_no_sync and micro < k - 1:
                with no_sync(opt):
                    model(x).backward()
            else:
                model(x).backward()
        opt.step()
        opt.zero_grad()
    return calls


def _count_collectives(rank: int, world: int) -> dict[str, Counter]:
    out = {}
    for stage in (1, 2):
        for overlap in (True, False):
            model = _Flat()
            groups = [{"params": list(model.ps)[:4]}, {"params": list(model.ps)[4:], "lr": 0.5}]
            opt = LowLevelZeroOptimizer(
                torch.optim.SGD(groups, lr=0.1),
                stage=stage,
                reduce_bucket_size=BUCKET,
                overlap_communication=overlap,
                param_gather="all_gather",
                # the reduce-scatter and all-reduce paths are counted here; gloo's default at the end
                comm_algorithm="reduce_scatter" if stage == 2 else "all_reduce",
            )
            for k, use_no_sync in ((1, False), (3, False), (3, True)):
                out[f"stage{stage}-overlap{overlap}-k{k}-nosync{use_no_sync}"] = _one_step(
                    opt, model, k, use_no_sync
                )
    # the gloo default exchanges the buckets with all_to_all_single (summed locally) and gathers the updated pieces
    # with one broadcast per rank and partition
    model = _Flat()
    opt = LowLevelZeroOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), stage=2, reduce_bucket_size=BUCKET
    )
    assert opt.param_gather == "broadcast" and opt.comm_algorithm == "all_to_all"
    out["stage2-default-gather"] = _one_step(opt, model, 1, False)
    return out


@pytest.fixture(scope="module")
def counts() -> dict[str, Counter]:
    return run_distributed(_count_collectives, 2, timeout=120)[0]


@pytest.mark.parametrize("overlap", [True, False])
def test_stage2_reduce_scatters_per_bucket_and_one_all_gather_per_partition(counts, overlap):
    one = counts[f"stage2-overlap{overlap}-k1-nosyncFalse"]
    assert one["reduce_scatter_tensor"] == BUCKETS
    assert one["reduce_scatter_tensor.elements"] == NPARAMS * NUMEL  # input: the padded gradient, once
    assert one["all_gather_into_tensor"] == 2  # two param groups of one dtype = two partitions
    assert one["all_gather_into_tensor.elements"] == NPARAMS * NUMEL // 2  # this rank's half
    assert one["all_reduce"] == 0


@pytest.mark.parametrize("stage", [1, 2])
def test_accumulation_reduces_every_micro_batch_or_once_per_window_under_no_sync(counts, stage):
    op = "reduce_scatter_tensor" if stage == 2 else "all_reduce"
    every = counts[f"stage{stage}-overlapTrue-k3-nosyncFalse"]
    window = counts[f"stage{stage}-overlapTrue-k3-nosyncTrue"]
    assert every[op] == 3 * BUCKETS
    assert window[op] == BUCKETS
    assert every["all_gather_into_tensor"] == window["all_gather_into_tensor"] == 2


def test_stage1_all_reduces_per_bucket(counts):
    one = counts["stage1-overlapTrue-k1-nosyncFalse"]
    assert one["all_reduce"] == BUCKETS
    assert one["reduce_scatter_tensor"] == 0
    assert one["all_gather_into_tensor"] == 2


# -- memory -----------------------------------------------------------------------------------------------
def _held_bytes(opt: LowLevelZeroOptimizer) -> int:
    total = 0
    for slot in opt.layout.slots:
        if slot.separate_master:
            total += slot.master.numel() * slot.master.element_size()
        if slot.grad is not None:
            total += slot.grad.numel() * slot.grad.element_size()
        for value in opt.optim.state.get(slot.master, {}).values():
            if torch.is_tensor(value) and value.dim() > 0:
                total += value.numel() * value.element_size()
    return total


def _storage_bytes(opt: LowLevelZeroOptimizer) -> int:
    """Bytes of the distinct storages behind the reduced pieces (a piece may view a bucket's row)."""
    storages = {
        s.grad.untyped_storage().data_ptr(): s.grad.untyped_storage().nbytes()
        for s in opt.layout.slots
        if s.grad is not None
    }
    return sum(storages.values())


def _memory(rank: int, world: int, algorithm: str) -> dict[str, float]:
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        # 5 layers of 41x41 (+41): 1681 and 41 elements, padded to 1684 and 44 at 4 ranks
        model = nn.Sequential(*[nn.Linear(41, 41) for _ in range(5)]).to(dtype)
        opt = LowLevelZeroOptimizer(
            torch.optim.AdamW(model.parameters(), lr=1e-3),
            stage=2,
            reduce_bucket_size=1500,
            comm_algorithm=algorithm,
        )
        x = torch.randn(4, 41, dtype=dtype)
        model(x).square().mean().backward()
        assert all(p.grad is None for p in model.parameters()), "ZeRO-2 keeps no full gradient after backward"
        opt.step()  # creates the Adam state
        model(x).square().mean().backward()
        opt.sync_grads()
        numel = sum(p.numel() for p in model.parameters())
        padded = sum(-(-p.numel() // world) * world for p in model.parameters())
        # unsharded figure of the same tensors: exp_avg + exp_avg_sq + grad in the master dtype (+ fp32 master)
        per_elem = 4 * 3 + (4 if dtype != torch.float32 else 0)
        out[str(dtype)] = _held_bytes(opt) / (numel * per_elem)
        out[str(dtype) + ".padding"] = (padded - numel) / numel
        # what the pieces keep alive: this rank's elements only (1/N of the padded gradient), never a whole
        # reduced bucket
        out[str(dtype) + ".storage"] = _storage_bytes(opt) / (padded * (4 if dtype == torch.float32 else 2))
        # buckets launched but not yet added into the pieces, at their peak during backward (elements)
        out[str(dtype) + ".peak_in_flight"] = opt._reducer.peak_in_flight / padded
    return out


@pytest.mark.parametrize("algorithm", ["all_reduce", "reduce_scatter", "all_to_all"])
def test_per_rank_memory_is_a_quarter_of_the_unsharded_figure_at_four_ranks(algorithm):
    results = run_distributed(_memory, 4, algorithm, timeout=120)
    for rank, ratios in enumerate(results):
        for dtype in ("torch.float32", "torch.bfloat16"):
            padding = ratios[dtype + ".padding"]
            assert padding < 0.0035  # 5 * (3 + 3) = 30 padding elements over 8610: 0.35%
            # each rank holds at most ceil(numel/4) per parameter: <= 1/4 + padding of the unsharded bytes
            assert ratios[dtype] <= 0.25 + padding, (rank, dtype, ratios[dtype])
            assert ratios[dtype] >= 0.25 - padding, (rank, dtype, ratios[dtype])  # and really holds its share
            # 5 buckets of 1728 padded elements per backward; at most MAX_IN_FLIGHT + 1 = 3 exist at once
            assert ratios[dtype + ".peak_in_flight"] <= 3 * 1728 / 8640 + 1e-9, (rank, dtype)
            # the pieces live in one store of this rank's elements in the masters' dtype (fp32 for bf16 params)
            assert 0 < ratios[dtype + ".storage"] <= (0.25 if dtype == "torch.float32" else 0.5) + 1e-9, (
                rank,
                dtype,
                ratios[dtype + ".storage"],
            )


def test_gloo_default_gathers_pieces_by_broadcast(counts):
    one = counts["stage2-default-gather"]
    assert one["broadcast"] == 2  # 2 ranks x 1 partition
    assert one["all_gather_into_tensor"] == 0
    assert one["all_to_all_single"] == BUCKETS and one["reduce_scatter_tensor"] == 0
    assert one["all_reduce"] == 0
