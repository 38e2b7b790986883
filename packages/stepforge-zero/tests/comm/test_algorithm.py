# SPDX-License-Identifier: Apache-2.0
"""``comm_algorithm``: the three paths (all-reduce the bucket and read this rank's pieces; reduce-scatter; the
``all_to_all`` exchange summed locally, gloo's default) give the same parameters, each path really runs its
collective, ``"auto"`` picks per backend, the environment variable forces ``"auto"``, and the in-place broadcast
of large parameters gathers the same values.

Same results, bit for bit, at 2 ranks: every path divides the gradients by the world size before the sum, and a
sum of two addends does not depend on the order it is done in. At 4 ranks the paths may add the four addends in
different orders (a few ulps): compared with the single-process reference at the parity tests' fp32 tolerance
instead.
"""

from __future__ import annotations

import pytest
import torch

from stepforge.core import HyperParameterError, build_optimizer, no_sync
from stepforge.testing.distributed import requires_gloo, run_distributed
from stepforge.testing.zero_cases import (
    counting,
    flat_params,
    loss_fn,
    make_model,
    micro_batches,
    optimizer_cfg,
    param_groups,
    reference_run,
)
from stepforge.zero.comm.algorithm import (
    COLOSSAL_BUCKET_SIZE,
    COLOSSAL_OPTIMIZER_BUCKET_SIZE,
    COMM_ALGORITHM_ENV,
    GLOO_BUCKET_SIZE,
    comm_algorithm_for,
)
from stepforge.zero.comm.param_gather import launch_gather
from stepforge.zero.low_level import LowLevelZeroOptimizer
from stepforge.zero.state.partition import build_layout

STEPS = 3


def _train(rank: int, world: int, stage: int, algorithm: str, accum: int, use_no_sync: bool) -> tuple:
    model = make_model()
    inner = build_optimizer(optimizer_cfg("AdamW"), param_groups(model))
    opt = LowLevelZeroOptimizer(
        inner, stage=stage, reduce_bucket_size=64, comm_algorithm=algorithm, max_norm=0.5
    )
    with counting() as calls:
        for step in range(STEPS):
            for micro, (x, y) in enumerate(micro_batches(step, accum, rank, world, torch.float32)):
                if use_no_sync and micro < accum - 1:
                    with no_sync(opt):
                        opt.backward(loss_fn(model, x, y) / accum)
                else:
                    opt.backward(loss_fn(model, x, y) / accum)
            opt.step()
            opt.zero_grad()
    counts = (calls["all_reduce"], calls["reduce_scatter_tensor"], calls["all_to_all_single"])
    return flat_params(model), opt.comm_algorithm, counts


def _both_paths(rank: int, world: int) -> dict:
    out: dict = {
        "default_bucket": LowLevelZeroOptimizer(
            torch.optim.SGD(make_model().parameters(), lr=0.1)
        ).reduce_bucket_size,
        "auto": [
            LowLevelZeroOptimizer(torch.optim.SGD(make_model().parameters(), lr=0.1), stage=s).comm_algorithm
            for s in (1, 2)
        ],
    }
    for stage in (1, 2):
        for accum, use_no_sync in ((1, False), (2, False), (3, True)):
            for algorithm in ("all_reduce", "reduce_scatter", "all_to_all"):
                out[(stage, accum, use_no_sync, algorithm)] = _train(
                    rank, world, stage, algorithm, accum, use_no_sync
                )
    return out


def _check_paths(results: list[dict], world: int, *, bitwise: bool) -> None:
    ref = flat_params(reference_run("AdamW", STEPS, 1, torch.float32, max_norm=0.5)[0])
    for rank, out in enumerate(results):
        assert out.pop("default_bucket") == GLOO_BUCKET_SIZE == 4 * 1024**2  # the measured gloo default
        assert out.pop("auto") == ["all_to_all", "all_to_all"]  # "auto" on gloo, both stages
        for (stage, accum, use_no_sync, algorithm), (params, chosen, counts) in out.items():
            case = (rank, stage, accum, use_no_sync, algorithm)
            assert chosen == algorithm, case
            # each path really ran its own collective (the clipping norm adds one small all-reduce per step)
            all_reduces, scatters, exchanges = counts
            if chosen == "reduce_scatter":
                assert scatters > 0 and all_reduces == STEPS and exchanges == 0, (case, counts)
            elif chosen == "all_to_all":
                assert exchanges > 0 and all_reduces == STEPS and scatters == 0, (case, counts)
            else:
                assert scatters == 0 and all_reduces > STEPS and exchanges == 0, (case, counts)
            other = out[(stage, accum, use_no_sync, "reduce_scatter")][0]
            if bitwise:
                assert torch.equal(params, other), case
            else:
                torch.testing.assert_close(params, other, rtol=1e-6, atol=1e-7)
            if accum == 1:
                torch.testing.assert_close(params, ref, rtol=1e-6, atol=1e-7)
            assert torch.equal(params, results[0][(stage, accum, use_no_sync, algorithm)][0]), case


@pytest.mark.distributed
@requires_gloo
def test_the_three_reduction_paths_agree_bit_for_bit_at_two_ranks():
    _check_paths(run_distributed(_both_paths, 2, timeout=240), 2, bitwise=True)


@pytest.mark.distributed
@requires_gloo
def test_the_three_reduction_paths_agree_at_four_ranks():
    _check_paths(run_distributed(_both_paths, 4, timeout=240), 4, bitwise=False)


# -- choosing -------------------------------------------------------------------------------------------
def test_bad_comm_algorithm_is_refused_naming_the_argument():
    with pytest.raises(HyperParameterError, match="comm_algorithm must be one of 'auto', 'all_reduce'"):
        LowLevelZeroOptimizer(torch.optim.SGD(make_model().parameters(), lr=0.1), comm_algorithm="ring")


def test_environment_variable_forces_auto_and_is_checked(monkeypatch):
    monkeypatch.setenv(COMM_ALGORITHM_ENV, "reduce_scatter")
    assert comm_algorithm_for("auto", stage=1, world_size=1, backend=None) == "reduce_scatter"
    # an explicit argument wins over the environment
    assert comm_algorithm_for("all_reduce", stage=2, world_size=1, backend=None) == "all_reduce"
    opt = LowLevelZeroOptimizer(torch.optim.SGD(make_model().parameters(), lr=0.1), stage=2)
    assert opt.comm_algorithm == "reduce_scatter"
    monkeypatch.setenv(COMM_ALGORITHM_ENV, "allreduce")
    with pytest.raises(
        HyperParameterError, match=f"environment variable {COMM_ALGORITHM_ENV} must be one of"
    ):
        LowLevelZeroOptimizer(torch.optim.SGD(make_model().parameters(), lr=0.1), stage=2)
    monkeypatch.delenv(COMM_ALGORITHM_ENV)
    # no process group: stage 1 all-reduces (ColossalAI's arithmetic), stage 2 reduce-scatters
    assert comm_algorithm_for("auto", stage=1, world_size=1, backend=None) == "all_reduce"
    assert comm_algorithm_for("auto", stage=2, world_size=1, backend=None) == "reduce_scatter"
    # and ColossalAI's bucket size off gloo (LowLevelZeroOptimizer's own default; the plugin's is 12 Mi)
    assert opt.reduce_bucket_size == COLOSSAL_OPTIMIZER_BUCKET_SIZE == 1024**2
    assert COLOSSAL_BUCKET_SIZE == 12 * 1024**2


# -- the in-place broadcast gather ---------------------------------------------------------------------------
def _gather_in_place(rank: int, world: int) -> dict:
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for direct_min in (1, 1 << 30):  # every parameter in place / every parameter staged
            torch.manual_seed(0)
            # 7 elements at 3 ranks: pieces 3, 3, 1; 2 elements: pieces 1, 1, 0 (rank 2 owns nothing)
            params = [
                torch.nn.Parameter(torch.zeros(7, dtype=dtype)),
                torch.nn.Parameter(torch.zeros(2, dtype=dtype)),
            ]
            layout = build_layout(
                [{"params": params}], world, rank, group=None, master_weights=True, master_device=None
            )
            for slot in layout.slots:
                slot.master.copy_(torch.arange(slot.start, slot.start + slot.valid, dtype=torch.float32) + 1)
            with counting() as calls:
                launch_gather(layout, "broadcast", direct_min=direct_min).wait_all()
            out[(str(dtype), direct_min)] = ([p.detach().float().clone() for p in params], calls["broadcast"])
    return out


@pytest.mark.distributed
@requires_gloo
def test_in_place_broadcast_gather_matches_the_staged_one_on_three_ranks():
    results = run_distributed(_gather_in_place, 3, timeout=120)
    for out in results:
        for (dtype, direct_min), (params, broadcasts) in out.items():
            assert torch.equal(params[0], torch.arange(1.0, 8.0)), (dtype, direct_min)
            assert torch.equal(params[1], torch.arange(1.0, 3.0)), (dtype, direct_min)
            # in place: one broadcast per non-empty piece (3 + 2); staged: one per rank
            assert broadcasts == (5 if direct_min == 1 else 3), (dtype, direct_min, broadcasts)
