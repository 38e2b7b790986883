# SPDX-License-Identifier: Apache-2.0
"""MemoryPlan's bookkeeping (merging, filters, ring bytes) and the default replicated plan every plugin inherits:
parameters, gradients, buffers and optimizer state of a meta model, tied weights once, frozen ones without
gradients or state."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from stepforge.core import MemoryPlan, PlannedCollective, PlannedTensor, Plugin
from stepforge.core.memory_plan import replicated_plan, tensor_bytes, unique_parameters


class _Replicated(Plugin):
    name = "replicated_test"

    def prepare(self, model, optimizer=None, **kwargs):
        return model, None


def _meta_model() -> nn.Module:
    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(100, 8), nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 100))
    model[3].weight = model[0].weight  # tied: 100 x 8 held once
    model[1].bias.requires_grad_(False)
    return model


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(component="activations"), "component"),
        (dict(place="gpu"), "place"),
        (dict(lifetime="always"), "lifetime"),
        (dict(nbytes=-1), "nbytes"),
    ],
)
def test_planned_tensor_rejects_unknown_values(kwargs: dict, field: str) -> None:
    """A planned tensor names one of the known components, places and lifetimes, with bytes >= 0."""
    base = dict(component="params", place="device", nbytes=1, label="x", lifetime="boost")
    with pytest.raises(ValueError, match=field):
        PlannedTensor(**{**base, **kwargs})


def test_plan_merges_tensors_of_one_kind_and_filters_totals() -> None:
    """Adding the same kind twice sums it; totals filter by component, place and lifetime; zero bytes and
    single-rank collectives are left out."""
    plan = MemoryPlan("p", 4, 0)
    plan.add("params", "device", 10, "w")
    plan.add("params", "device", 5, "w")
    plan.add("grads", "host", 7, "g", "grads")
    plan.add("buffers", "device", 0, "nothing")
    plan.collective("all_reduce", "backward", 3, 400, 4, "buckets")
    plan.collective("all_reduce", "backward", 3, 400, 1, "alone")
    assert [(t.component, t.nbytes) for t in plan.tensors] == [("params", 15), ("grads", 7)]
    assert plan.total() == 22
    assert plan.total(place="device") == 15
    assert plan.total(lifetimes=("grads",)) == 7
    assert plan.total(component="grads", place="device") == 0
    assert len(plan.collectives) == 1


@pytest.mark.parametrize(
    ("op", "sent"), [("all_reduce", 2 * 3 * 1000 // 4), ("reduce_scatter", 750), ("all_gather", 750)]
)
def test_sent_bytes_are_the_ring_algorithms(op: str, sent: int) -> None:
    """A rank sends 2(n-1)/n of an all-reduce's payload and (n-1)/n of a reduce-scatter's or all-gather's."""
    assert PlannedCollective(op, "backward", 1, 1000, 4, "x").sent_bytes == sent
    assert PlannedCollective(op, "backward", 1, 1000, 1, "x").sent_bytes == 0


def test_replicated_plan_of_a_meta_model() -> None:
    """The default plan: every unique parameter once (tied ones too) in its dtype, gradients for the trainable
    ones, the buffers, AdamW's two fp32 moments per trainable element plus a 4-byte step counter on the CPU per
    trainable tensor, and the temporaries of its step; nothing communicated."""
    model = _meta_model()
    params = [p for _, p in unique_parameters(model)]
    assert len(params) == 6  # embedding (tied with the head weight), Linear w+b, BatchNorm w+b, head bias
    numel = 100 * 8 + (64 + 8) + (8 + 8) + 100
    trainable = numel - 8
    plan = _Replicated(device="cpu").memory_plan(model, world_size=8, optimizer=dict(type="AdamW", lr=1e-3))
    assert plan.total(component="params") == numel * 4
    assert plan.total(component="grads", lifetimes=("grads",)) == trainable * 4
    assert plan.total(component="buffers", lifetimes=("boost",)) == (8 + 8) * 4 + 8  # BatchNorm's statistics
    # torch's single-tensor AdamW step holds 8 bytes an element of the tensor it updates and 4 of the previous
    assert plan.total(component="buffers", lifetimes=("update",)) == 8 * 800 + 4 * 100
    assert plan.total(component="optimizer_state", place="device") == trainable * 8
    assert plan.total(component="optimizer_state", place="host") == 5 * 4  # the frozen bias has none
    assert plan.collectives == [] and plan.full_grads
    assert plan == replicated_plan(
        "replicated_test", model, world_size=8, optimizer=dict(type="AdamW", lr=1e-3)
    )


def test_replicated_plan_without_optimizer_has_no_state() -> None:
    """No optimizer config: no optimizer state."""
    plan = _Replicated(device="cpu").memory_plan(_meta_model(), world_size=1)
    assert plan.total(component="optimizer_state") == 0


def test_tensor_bytes() -> None:
    """Elements times the dtype's size."""
    assert tensor_bytes(10, torch.bfloat16) == 20
    assert tensor_bytes(3, torch.float64) == 24
