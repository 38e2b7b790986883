# SPDX-License-Identifier: Apache-2.0
"""ZeroRedundancyOptimizer: registry-resolved local optimizers against a single-process run on the whole batch,
a consolidated checkpoint resumed at another world size, the bounded wait of a one-rank state_dict(), and bad or
missing arguments named in the error (a missing optimizer_type is a TypeError, as mmengine's own test expects).

Reference: the same model and data on one process with the plain optimizer (torch.optim.AdamW for "AdamW" and
"FusedAdam"; stepforge.optim.Lamb for "Lamb"), loss = mean over the concatenated batch. The distributed runs
average gradients with DDP (a sum over ranks then a division), which rounds differently from the single-process
mean; after a few Adam steps that stays below rtol 1e-5 / atol 1e-6 (measured: about 1e-7).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from stepforge.core import OPTIMIZERS, HyperParameterError, UnknownNameError, build_optimizer
from stepforge.testing.distributed import requires_gloo, run_distributed
from stepforge.testing.zero_cases import (
    assert_all_close,
    mlp,
    param_copies,
    rank_rows,
    regression_batch,
    train_reference,
)
from stepforge.zero import CollectiveCallError, MissingArgumentError, ZeroRedundancyOptimizer

RTOL, ATOL = 1e-5, 1e-6
GLOBAL_BATCH = 12  # divisible by 2 and 3
STEPS_BEFORE, STEPS_AFTER = 3, 3
CASES = {
    # name: (optimizer_type, kwargs, reference class, param groups?)
    "adamw_groups": ("AdamW", dict(lr=1e-2, weight_decay=0.1), torch.optim.AdamW, True),
    "fused_adam": ("FusedAdam", dict(lr=1e-2, weight_decay=0.05), torch.optim.AdamW, False),
    "lamb": ("Lamb", dict(lr=1e-2, weight_decay=0.01), None, False),
}


def _model() -> torch.nn.Module:
    return mlp((6, 16, 3))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return regression_batch(1000 + step, GLOBAL_BATCH, 6, 3)


def _params(model: torch.nn.Module, groups: bool, kwargs: dict) -> list:
    if not groups:
        return list(model.parameters())
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": weights}, {"params": biases, "lr": kwargs["lr"] / 2, "weight_decay": 0.0}]


def _reference(case: str, steps: int) -> tuple[list[torch.Tensor], dict]:
    optimizer_type, kwargs, ref_cls, groups = CASES[case]
    model = _model()
    cls = ref_cls if ref_cls is not None else OPTIMIZERS.get(optimizer_type)
    optimizer = cls(_params(model, groups, kwargs), **kwargs)
    params = train_reference(model, optimizer, ([_batch(step)] for step in range(steps)))
    return params, optimizer.state_dict()


def _train(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int, world: int, steps: range
) -> None:
    ddp = DDP(model)
    sl = rank_rows(rank, world, GLOBAL_BATCH)
    for step in steps:
        x, y = _batch(step)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(ddp(x[sl]), y[sl]).backward()
        optimizer.step()


def _first_half(rank: int, world: int) -> dict:
    """Every case for STEPS_BEFORE steps; returns params and the consolidated state by case."""
    out = {}
    for case, (optimizer_type, kwargs, _, groups) in CASES.items():
        model = _model()
        if case == "fused_adam":  # through the registry, as a config would
            optimizer = build_optimizer(
                dict(type="ZeroRedundancyOptimizer", optimizer_type=optimizer_type, **kwargs), model
            )
        else:
            optimizer = ZeroRedundancyOptimizer(_params(model, groups, kwargs), optimizer_type, **kwargs)
        assert isinstance(optimizer, ZeroRedundancyOptimizer)
        _train(model, optimizer, rank, world, range(STEPS_BEFORE))
        state = optimizer.state_dict()  # collective, every rank
        assert (state != {}) == (rank == 0), (rank, list(state))
        out[case] = (param_copies(model), state)
    return out


def _second_half(rank: int, world: int, saved: dict) -> dict:
    """Load each case's state at another world size, train on; then one rank alone calls state_dict()."""
    out = {}
    for case, (optimizer_type, kwargs, _, groups) in CASES.items():
        params, state = saved[case]
        model = _model()
        with torch.no_grad():
            for p, q in zip(model.parameters(), params, strict=True):
                p.copy_(q)
        optimizer = ZeroRedundancyOptimizer(_params(model, groups, kwargs), optimizer_type, **kwargs)
        optimizer.load_state_dict(state)
        _train(model, optimizer, rank, world, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
        out[case] = param_copies(model)
    # the bounded wait: rank 0 calls the collective alone
    optimizer = ZeroRedundancyOptimizer(_model().parameters(), "SGD", lr=0.1, consolidate_timeout=2.0)
    if rank == 0:
        start = time.monotonic()
        with pytest.raises(CollectiveCallError, match="every rank of the process group") as info:
            optimizer.state_dict()
        out["lonely_call_s"] = time.monotonic() - start
        out["lonely_message"] = str(info.value)
    dist.barrier()  # the others wait here until rank 0 gave up
    # the group is still usable: a call by every rank now works
    state = optimizer.state_dict()
    assert (state != {}) == (rank == 0)
    return out


def _assert_close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert_all_close(got, want, rtol=RTOL, atol=ATOL)


@requires_gloo
def test_matches_single_process_and_resumes_at_another_world_size():
    first = run_distributed(_first_half, 2, timeout=120)
    for case in CASES:
        ref_params, ref_state = _reference(case, STEPS_BEFORE)
        for rank in range(2):
            _assert_close(first[rank][case][0], ref_params)
        # the consolidated state is the reference optimizer's state, keyed by global index
        state = first[0][case][1]
        assert sorted(state["state"]) == sorted(ref_state["state"])
        for index, ref in ref_state["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(state["state"][index][key], ref[key], rtol=RTOL, atol=1e-8)
            assert float(state["state"][index]["step"]) == STEPS_BEFORE
        assert [len(g["params"]) for g in state["param_groups"]] == [
            len(g["params"]) for g in ref_state["param_groups"]
        ]
        assert [g["lr"] for g in state["param_groups"]] == [g["lr"] for g in ref_state["param_groups"]]

    saved = {case: (first[0][case][0], first[0][case][1]) for case in CASES}
    second = run_distributed(_second_half, 3, saved, timeout=120)
    for case in CASES:
        ref_params, _ = _reference(case, STEPS_BEFORE + STEPS_AFTER)
        for rank in range(3):
            _assert_close(second[rank][case], ref_params)
    assert 2.0 <= second[0]["lonely_call_s"] < 2.0 + 10.0, second[0]["lonely_call_s"]
    assert "consolidate_timeout=2" in second[0]["lonely_message"]


def test_unknown_optimizer_type_gives_the_registry_error():
    with pytest.raises(UnknownNameError, match="unknown optimizer 'NoSuchAdam'"):
        ZeroRedundancyOptimizer(_model().parameters(), "NoSuchAdam", lr=1e-3)


def test_bad_arguments_are_named():
    params = list(_model().parameters())
    with pytest.raises(HyperParameterError, match="consolidate_timeout"):
        ZeroRedundancyOptimizer(params, "AdamW", consolidate_timeout=0)
    with pytest.raises(HyperParameterError, match="optimizer_type must be an optimizer name"):
        ZeroRedundancyOptimizer(params, 3)
    with pytest.raises(HyperParameterError, match="max_grad_norm=1.0 clips by a norm over all parameters"):
        ZeroRedundancyOptimizer(params, "Lamb", max_grad_norm=1.0)
    with pytest.raises(HyperParameterError, match="overlap_with_ddp"):
        ZeroRedundancyOptimizer(params, "AdamW", overlap_with_ddp=True)


def test_a_missing_optimizer_type_is_a_type_error_naming_it():
    # mmengine's test_zero_redundancy_optimizer builds it without optimizer_type and expects TypeError, as Python
    # raises for a missing argument; the error is also a HyperParameterError that names the fix
    for build in (
        lambda: ZeroRedundancyOptimizer(_model().parameters(), lr=1e-3),
        lambda: build_optimizer(dict(type="ZeroRedundancyOptimizer", lr=1e-3, momentum=0.1), _model()),
    ):
        with pytest.raises(TypeError, match="optimizer_type='AdamW'") as caught:
            build()
        assert isinstance(caught.value, MissingArgumentError) and isinstance(
            caught.value, HyperParameterError
        )


def test_needs_an_initialised_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        ZeroRedundancyOptimizer(_model().parameters(), "AdamW", lr=1e-3)


def test_registered_as_an_optimizer():
    assert OPTIMIZERS.get("ZeroRedundancyOptimizer") is ZeroRedundancyOptimizer
    assert OPTIMIZERS.describe()["zeroredundancyoptimizer"].distribution == "stepforge-zero"
