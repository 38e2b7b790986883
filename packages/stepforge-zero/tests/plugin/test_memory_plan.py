# SPDX-License-Identifier: Apache-2.0
"""The zero1/zero2 memory plan against the optimizer it describes: on 2 gloo ranks, after a real backward and
step, the plan's gradient pieces, masters, kept bucket buffers and gather tables are the bytes the real
optimizer holds, and its collectives are the calls the optimizer made; at one process too. The rules the plan
shares with the optimizer (bucket size, algorithm and gather method per backend, the broadcast gather's split)
are checked on their own."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from stepforge.testing.distributed import requires_gloo, run_distributed
from stepforge.testing.fake_world import CollectiveRecorder
from stepforge.testing.zero_cases import mlp, regression_batch
from stepforge.zero import LowLevelZeroPlugin
from stepforge.zero.comm.algorithm import (
    COLOSSAL_BUCKET_SIZE,
    GLOO_BUCKET_SIZE,
    bucket_size_for,
    comm_algorithm_for,
    param_gather_for,
)
from stepforge.zero.comm.param_gather import split_direct

#: small buckets (about 600 elements) so a 4-layer MLP launches several
SETTINGS: list[dict[str, Any]] = [
    dict(stage=1, precision="bf16", reduce_bucket_size_in_m=0.0006),
    dict(stage=2, precision="bf16", reduce_bucket_size_in_m=0.0006),
    dict(stage=2, precision="fp32", reduce_bucket_size_in_m=0.0006, cpu_offload=True),
    dict(stage=2, precision="bf16", overlap_allgather=True),
]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(6, 40), torch.nn.Tanh(), torch.nn.Linear(40, 24), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(24, 40), torch.nn.Tanh(), torch.nn.Linear(40, 3))


def _label(plan: Any, label: str) -> int:
    return sum(t.nbytes for t in plan.tensors if t.label == label)


def _measure(settings: dict[str, Any]) -> dict[str, Any]:
    """One backward and step of ``settings`` on this rank: what the optimizer holds and the calls it made, and
    the plan of the same configuration."""
    plugin = LowLevelZeroPlugin(**settings)
    world = dist.get_world_size() if dist.is_initialized() else 1
    plan = plugin.memory_plan(
        _model(), world_size=world, rank=dist.get_rank() if dist.is_initialized() else 0,
        optimizer=dict(type="AdamW", lr=1e-3), backend="gloo" if world > 1 else None,
    )  # fmt: skip
    model = _model()
    model, optimizer = plugin.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    x, y = regression_batch(3, 4, 6, 3)
    with CollectiveRecorder() as recorder:
        optimizer.backward(torch.nn.functional.mse_loss(model(x).float(), y))
        optimizer.step()
        optimizer.wait_for_param_gather()
    slots = optimizer.layout.slots
    recorded = recorder.totals()
    planned: dict[str, tuple[int, int]] = {}
    for c in plan.collectives:
        calls, nbytes = planned.get(c.op, (0, 0))
        planned[c.op] = (calls + c.calls, nbytes + c.nbytes)
    return dict(
        grads=sum(s.grad.numel() * s.grad.element_size() for s in slots if s.grad is not None),
        masters=sum(s.master.numel() * s.master.element_size() for s in slots if s.separate_master),
        pool=optimizer._reducer.pool.held_bytes,
        staging=optimizer._staging.held_bytes,
        reductions=optimizer.collective_counts.reductions,
        recorded={op: calls for op, (calls, _) in recorded.items()},
        plan_grads=plan.total(component="grads", lifetimes=("step",)),
        plan_masters=plan.total(component="master"),
        plan_pool=_label(plan, "gradient bucket buffers (kept)"),
        plan_staging=_label(plan, "parameter gather tables (kept)"),
        planned={op: calls for op, (calls, _) in planned.items()},
        planned_bytes=planned,
        state=sum(v.numel() * v.element_size() for st in optimizer.optim.state.values() for v in st.values()),
        plan_state=plan.total(component="optimizer_state"),
    )


def _measure_all(rank: int, world: int) -> list[dict[str, Any]]:
    return [_measure(s) for s in SETTINGS]


def _check(m: dict[str, Any]) -> None:
    assert m["grads"] == m["plan_grads"]
    assert m["masters"] == m["plan_masters"]
    assert m["pool"] == m["plan_pool"]
    assert m["staging"] == m["plan_staging"]
    assert m["state"] == m["plan_state"]


@requires_gloo
def test_plan_equals_what_the_optimizer_holds_and_calls_at_two_ranks() -> None:
    """Stage 1 and 2 in bf16, stage 2 fp32 with CPU offload, stage 2 with the overlapped gather, on 2 gloo ranks:
    the plan's gradient pieces, separate masters, optimizer state, kept bucket buffers and kept gather tables are
    the bytes the optimizer holds after a backward and a step, and its collectives are the calls it made (the
    all-to-all reductions and the broadcasts of the gather, several buckets each)."""
    for rank_results in run_distributed(_measure_all, 2):
        for settings, m in zip(SETTINGS, rank_results, strict=True):
            _check(m)
            assert m["recorded"] == m["planned"], settings
            assert m["planned"]["all_to_all"] == m["reductions"]
            assert m["reductions"] > (2 if settings.get("reduce_bucket_size_in_m") else 0)
            assert m["planned"]["broadcast"] >= 2
            if settings["precision"] == "bf16":
                assert m["masters"] > 0  # fp32 masters of bf16 pieces
            else:
                assert m["masters"] == 0  # an fp32 piece on the CPU is a view of its parameter


def _window(rank: int, world: int, steps: int) -> list[dict[str, Any]]:
    """A window of ``steps`` micro-batches (all but the last under the plugin's ``no_sync``) and its step, for
    stage 2 in bf16 and stage 1 in fp32 with CPU offload: the local gradients held before the last backward, the
    collectives of the whole window, and the plan of the same window."""
    out = []
    for settings in (SETTINGS[1], dict(SETTINGS[2], stage=1)):
        plugin = LowLevelZeroPlugin(**settings)
        plan = plugin.memory_plan(
            _model(), world_size=world, rank=rank, optimizer=dict(type="AdamW", lr=1e-3), backend="gloo",
            accumulation_steps=steps,
        )  # fmt: skip
        model = _model()
        model, optimizer = plugin.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        x, y = regression_batch(3, 4, 6, 3)
        slots = optimizer.layout.slots
        local = 0
        with CollectiveRecorder() as recorder:
            for i in range(steps):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
                if i < steps - 1:
                    with plugin.no_sync(model, optimizer):
                        optimizer.backward(loss)
                    local = sum(s.param.grad.numel() * s.param.grad.element_size() for s in slots)
                else:
                    optimizer.backward(loss)
            optimizer.step()
            optimizer.wait_for_param_gather()
        planned: dict[str, int] = {}
        for c in plan.collectives:
            planned[c.op] = planned.get(c.op, 0) + c.calls
        out.append(
            dict(
                local=local,
                left=sum(1 for s in slots if s.param.grad is not None),
                plan_window=plan.total(lifetimes=("window",)),
                plan_window_device=plan.total(lifetimes=("window",), place="device"),
                recorded={op: calls for op, (calls, _) in recorder.totals().items()},
                planned=planned,
                reductions=optimizer.collective_counts.reductions,
                grads=sum(s.grad.numel() * s.grad.element_size() for s in slots if s.grad is not None),
                plan_grads=plan.total(component="grads", lifetimes=("step",)),
            )
        )
    return out


@requires_gloo
def test_plan_of_an_accumulation_window_at_two_ranks() -> None:
    """Three micro-batches per step on 2 gloo ranks (stage 2 bf16; stage 1 fp32 offloaded): under ``no_sync`` every
    parameter keeps its whole local gradient in the working dtype on the device, the bytes the plan holds for the
    window; the last backward takes them (none left after the step), the buckets are reduced once per window and
    the window's collectives are the plan's calls; the reduced pieces are the plan's as without accumulation."""
    for rank_results in run_distributed(_window, 2, 3):
        for m in rank_results:
            assert m["local"] > 0 and m["local"] == m["plan_window"] == m["plan_window_device"]
            assert m["left"] == 0
            assert m["recorded"] == m["planned"]
            assert m["planned"]["all_to_all"] == m["reductions"] > 2
            assert m["grads"] == m["plan_grads"]


def test_plan_equals_what_the_optimizer_holds_on_one_process() -> None:
    """Without a process group (one rank): the same equalities, and no collectives in the plan."""
    for settings in SETTINGS[:2]:
        m = _measure(settings)
        _check(m)
        assert m["planned"] == {}


def test_backend_rules_without_a_group() -> None:
    """The rules the optimizer applies to its live group, given the backend: gloo gets 4 Mi-element buckets,
    the all-to-all reduction and the broadcast gather; others ColossalAI's 12 Mi, an all-reduce (stage 1) or a
    reduce-scatter (stage 2), and the all-gather; one rank gets the defaults of a group-less run."""
    assert bucket_size_for("gloo", 2) == GLOO_BUCKET_SIZE
    assert bucket_size_for("nccl", 2) == bucket_size_for("gloo", 1) == COLOSSAL_BUCKET_SIZE
    assert comm_algorithm_for("auto", stage=2, world_size=8, backend="gloo") == "all_to_all"
    assert comm_algorithm_for("auto", stage=1, world_size=8, backend="nccl") == "all_reduce"
    assert comm_algorithm_for("auto", stage=2, world_size=8, backend="nccl") == "reduce_scatter"
    assert comm_algorithm_for("all_reduce", stage=2, world_size=8, backend="gloo") == "all_reduce"
    assert param_gather_for("gloo") == "broadcast"
    assert param_gather_for("nccl") == param_gather_for(None) == "all_gather"


def test_split_direct_keeps_large_contiguous_slots_in_place() -> None:
    """The broadcast gather sends in place the contiguous parameters of at least ``direct_min`` elements and
    stages the rest (a transposed view is not contiguous), in order."""
    from stepforge.zero.state.partition import build_layout

    params = [torch.zeros(10, 10), torch.zeros(3), torch.zeros(10, 12).t(), torch.zeros(200)]
    layout = build_layout([{"params": params}], 2, 0, group=None, master_weights=True, master_device=None)
    direct, staged = split_direct(layout.partitions[0].slots, 100)
    assert [s.index for s in direct] == [0, 3]
    assert [s.index for s in staged] == [1, 2]


@pytest.mark.parametrize("stage", [1, 2])
def test_plan_at_scale_is_one_nth_of_the_model(stage: int) -> None:
    """At 1024 ranks in bf16 the plan's fp32 masters, gradient pieces and AdamW state are 4, 4 and 8 bytes per
    element of rank 0's pieces (``ceil(n / 1024)`` of every parameter), the working parameters the whole model
    in bf16; accumulating 4 micro-batches adds the whole model's bf16 gradients for the window and not one
    collective."""
    model = mlp((512, 1024, 1000))
    numels = [p.numel() for p in model.parameters()]
    pieces = sum(-(-n // 1024) for n in numels)
    plan = LowLevelZeroPlugin(stage=stage, precision="bf16").memory_plan(
        model, world_size=1024, optimizer=dict(type="AdamW", lr=1e-3), backend="nccl"
    )
    assert plan.total(component="params") == 2 * sum(numels)
    assert plan.total(component="master") == 4 * pieces
    assert plan.total(component="grads", lifetimes=("step",)) == 4 * pieces
    assert plan.total(component="optimizer_state", place="device") == 8 * pieces
    window = LowLevelZeroPlugin(stage=stage, precision="bf16").memory_plan(
        model, world_size=1024, optimizer=dict(type="AdamW", lr=1e-3), backend="nccl", accumulation_steps=4
    )
    assert window.total(lifetimes=("window",)) == 2 * sum(numels)  # no_sync: the whole model's bf16 gradients
    assert [(c.op, c.calls, c.nbytes) for c in window.collectives] == [
        (c.op, c.calls, c.nbytes) for c in plan.collectives
    ]  # reduced once per optimizer step, as without accumulation
