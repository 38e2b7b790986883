# SPDX-License-Identifier: Apache-2.0
"""The memory plans of torch_ddp, torch_fsdp and gemini against the engines they describe, on 2 gloo ranks: DDP's
buckets (counted by a communication hook) and bytes; FSDP2's units, padded shards, gradients after backward,
optimizer state after a step and the collectives it called; gemini's replicated and offloaded units. And FSDP2's
row split against ``torch.chunk``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from stepforge.strategy.plugins import GeminiPlugin, TorchDDPPlugin, TorchFSDPPlugin
from stepforge.strategy.plugins.torch_fsdp import shard_rows
from stepforge.testing.distributed import requires_gloo, run_distributed
from stepforge.testing.fake_world import CollectiveRecorder


def _model() -> nn.Module:
    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(30, 30), nn.Tanh()) for _ in range(4))
    return nn.Sequential(nn.Linear(7, 30), *blocks, nn.Linear(30, 5))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(7, 30)
        self.blocks = nn.ModuleList(nn.Linear(30, 30) for _ in range(4))
        self.out = nn.Linear(30, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = torch.tanh(block(x))
        result: torch.Tensor = self.out(x)
        return result


@pytest.mark.parametrize("shards", [1, 3, 8, 64])
@pytest.mark.parametrize("dim0", [1, 7, 64, 100])
def test_shard_rows_is_torch_chunk_padded(dim0: int, shards: int) -> None:
    """Shard ``i`` holds ``torch.chunk``'s ``i``-th piece of dimension 0 (empty past the last piece); every shard's
    storage is padded to the first piece's rows."""
    pieces = torch.arange(dim0).chunk(shards)
    for index in range(shards):
        rows, padded = shard_rows(dim0, shards, index)
        assert rows == (len(pieces[index]) if index < len(pieces) else 0)
        assert padded == len(pieces[0])


def _ddp(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    plugin = TorchDDPPlugin(bucket_cap_mb=0.004, device="cpu")  # 4 KiB buckets: several for this model
    plan = plugin.memory_plan(_Net(), world_size=world, optimizer=dict(type="SGD", lr=0.1, momentum=0.9))
    model, _optimizer = plugin.prepare(_Net(), None)
    sizes: list[int] = []

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations against its own classes
        sizes.append(bucket.buffer().numel() * bucket.buffer().element_size())
        return allreduce_hook(state, bucket)

    model.register_comm_hook(None, hook)
    for _ in range(2):  # DDP rebuilds its buckets after the first iteration
        sizes.clear()
        model(torch.randn(4, 7)).sum().backward()
    collective = next(c for c in plan.collectives if c.op == "all_reduce")
    return dict(buckets=len(sizes), bytes=sum(sizes), planned=(collective.calls, collective.nbytes),
                plan_buffers=plan.total(component="buffers"))  # fmt: skip


@requires_gloo
def test_ddp_plan_counts_the_buckets_ddp_reduces() -> None:
    """With 4 KiB buckets DDP all-reduces the number of buckets its bucket assignment gives (counted by a
    communication hook, after its rebuild) carrying every gradient once; the plan keeps one copy of the
    gradients as bucket memory."""
    for r in run_distributed(_ddp, 2):
        assert r["buckets"] > 2
        assert (r["buckets"], r["bytes"]) == r["planned"]
        assert r["plan_buffers"] == r["bytes"]


def _local_bytes(tensors: Any) -> int:
    from torch.distributed.tensor import DTensor

    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _fsdp(rank: int, world: int, which: str) -> dict[str, Any]:
    from torch.distributed.fsdp import FSDPModule

    plugin: TorchFSDPPlugin
    if which == "gemini":
        plugin = GeminiPlugin(precision="bf16", shard_param_frac=0.6, offload_optim_frac=0.3, device="cpu")
    else:
        plugin = TorchFSDPPlugin(precision="bf16", device="cpu")
    plan = plugin.memory_plan(_Net(), world_size=world, rank=rank, optimizer=dict(type="AdamW", lr=1e-3))
    model, optimizer = plugin.prepare(_Net(), dict(type="AdamW", lr=1e-3))
    with CollectiveRecorder() as recorder:
        optimizer.backward(model(torch.randn(4, 7)).float().sum())
    optimizer.step()
    params = list(model.parameters())
    planned: dict[str, tuple[int, int]] = {}
    for c in plan.collectives:
        calls, nbytes = planned.get(c.op, (0, 0))
        planned[c.op] = (calls + c.calls, nbytes + c.nbytes)
    state = optimizer.unwrap().state
    return dict(
        units=sum(1 for m in model.modules() if isinstance(m, FSDPModule)),
        params=_local_bytes(params),
        grads=_local_bytes(p.grad for p in params),
        state=_local_bytes(v for st in state.values() for v in st.values()),
        recorded=recorder.totals(),
        planned=planned,
        plan_params=plan.total(component="params", lifetimes=("boost",)),
        plan_grads=plan.total(component="grads", lifetimes=("grads",)),
        plan_state=plan.total(component="optimizer_state"),
        offloaded=plan.total(component="params", place="host"),
        replicated=[n for n, p in model.named_parameters() if tuple(p.to_local().shape) == tuple(p.shape)],
        fsdp_names=sorted(n for n, m in model.named_modules() if isinstance(m, FSDPModule)),
        unit_names=sorted(u.name for u in plan.units),
        root=plan.units[-1],
        blocks_resharded=all(u.resharded for u in plan.units[:-1]),
        gathered=sum(u.gathered for u in plan.units),
        bf16_bytes=sum(p.numel() * 2 for p in _Net().parameters()),
    )


@requires_gloo
@pytest.mark.parametrize("which", ["torch_fsdp", "gemini"])
def test_fsdp_plan_equals_the_shards_grads_state_and_collectives(which: str) -> None:
    """On 2 gloo ranks in bf16: the plan's parameter bytes are FSDP2's padded local shards, its gradient bytes
    the sharded gradients after backward, its optimizer state AdamW's after a step, and its all-gathers,
    reduce-scatters and all-reduces (count and bytes) exactly what FSDP2 called, its units FSDP2's; gemini with
    ``shard_param_frac=0.6, offload_optim_frac=0.3`` replicates its trailing units and offloads leading ones."""
    for r in run_distributed(_fsdp, 2, which):
        assert r["units"] == 5  # 4 blocks and the root (input and output layers)
        assert r["params"] == r["plan_params"]
        assert r["grads"] == r["plan_grads"]
        assert r["state"] == r["plan_state"]
        assert r["recorded"] == r["planned"]
        # the units the estimate composes the peak from are FSDP2's: the root last, never resharded
        assert r["unit_names"] == r["fsdp_names"] and r["root"].name == "" and not r["root"].resharded
        assert r["blocks_resharded"] and r["bf16_bytes"] <= r["gathered"] < 1.2 * r["bf16_bytes"]
        if which == "gemini":
            assert r["replicated"] and r["offloaded"] > 0 and "all_reduce" in r["planned"]
        else:
            assert not r["replicated"] and r["offloaded"] == 0 and "all_reduce" not in r["planned"]


def _ddp_window(steps: int, x: torch.Tensor) -> dict[str, Any]:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    plugin = TorchDDPPlugin(bucket_cap_mb=0.004, device="cpu")
    plan = plugin.memory_plan(
        _Net(), world_size=2, optimizer=dict(type="SGD", lr=0.1), accumulation_steps=steps
    )
    model, _optimizer = plugin.prepare(_Net(), None)
    sizes: list[int] = []

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations against its own classes
        sizes.append(bucket.buffer().numel() * bucket.buffer().element_size())
        return allreduce_hook(state, bucket)

    model.register_comm_hook(None, hook)
    model(x).sum().backward()  # DDP rebuilds its buckets after the first iteration
    model.zero_grad(set_to_none=True)
    sizes.clear()
    for i in range(steps):
        if i < steps - 1:
            with plugin.no_sync(model):
                model(x).sum().backward()
        else:
            model(x).sum().backward()
    (collective,) = plan.collectives
    return dict(
        reduced=(len(sizes), sum(sizes)),
        planned=(collective.calls, collective.nbytes),
        grads=_local_bytes(p.grad for p in model.parameters()),
        plan_summed=plan.total(lifetimes=("accumulated",)),
        plan_window=plan.total(lifetimes=("window",)),
    )


def _fsdp_window(steps: int, x: torch.Tensor, which: str, rank: int) -> dict[str, Any]:
    from stepforge.core.torch_compat import memory_tracker, tracker_bytes

    plugin: TorchFSDPPlugin
    if which == "gemini":
        plugin = GeminiPlugin(precision="bf16", shard_param_frac=0.6, offload_optim_frac=0.3, device="cpu")
    else:
        plugin = TorchFSDPPlugin(precision="bf16", device="cpu")
    adamw = dict(type="AdamW", lr=1e-3)
    plan = plugin.memory_plan(_Net(), world_size=2, rank=rank, optimizer=adamw, accumulation_steps=steps)
    model, optimizer = plugin.prepare(_Net(), adamw)
    kept = 0
    with CollectiveRecorder() as recorder:
        for i in range(steps):
            if i < steps - 1 and plugin.supports_no_sync():
                tracker = memory_tracker()
                with (
                    tracker
                ):  # what the first micro-batch leaves besides the parameters it saw, from its start
                    with plugin.no_sync(model):
                        optimizer.backward(model(x).float().sum())
                    snap = tracker_bytes(tracker)["cpu"]
                    kept = kept or snap["Total"] - snap["Parameter"] - snap["Buffer"]
            else:
                optimizer.backward(model(x).float().sum())
    planned: dict[str, tuple[int, int]] = {}
    for c in plan.collectives:
        calls, nbytes = planned.get(c.op, (0, 0))
        planned[c.op] = (calls + c.calls, nbytes + c.nbytes)
    return dict(
        kept=kept,
        plan_window=plan.total(lifetimes=("window",)),
        grads=_local_bytes(p.grad for p in model.parameters()),
        plan_grads=plan.total(component="grads", lifetimes=("grads", "accumulated")),
        plan_summed=plan.total(lifetimes=("accumulated",)),
        recorded=recorder.totals(),
        planned=planned,
    )


def _windows(rank: int, world: int, steps: int) -> dict[str, dict[str, Any]]:
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(rank))
    return dict(
        torch_ddp=_ddp_window(steps, x),
        torch_fsdp=_fsdp_window(steps, x, "torch_fsdp", rank),
        gemini=_fsdp_window(steps, x, "gemini", rank),
    )


@requires_gloo
def test_plans_of_an_accumulation_window_at_two_ranks() -> None:
    """Three micro-batches per step on 2 gloo ranks, all but the last under ``no_sync`` where the plugin has it: DDP
    all-reduces its buckets once for the window and keeps the full gradients in ``param.grad`` through it (the
    plan's summed gradients); FSDP2 in bf16 keeps each unit's unsharded gradient in fp32 after a ``no_sync``
    backward (counted by MemTracker: the plan's window bytes), gathers its units every micro-batch and
    reduce-scatters once; gemini, without ``no_sync``, reduces every micro-batch into its sharded gradients (the
    plan's summed gradients); every collective (calls and bytes) as planned."""
    for r in run_distributed(_windows, 2, 3):
        ddp, fsdp, gemini = r["torch_ddp"], r["torch_fsdp"], r["gemini"]
        assert ddp["reduced"] == ddp["planned"] and ddp["planned"][0] > 2
        assert ddp["grads"] == ddp["plan_summed"] > 0 and ddp["plan_window"] == 0
        assert fsdp["kept"] == fsdp["plan_window"] > 0
        assert fsdp["grads"] == fsdp["plan_grads"] and fsdp["plan_summed"] == 0
        assert fsdp["recorded"] == fsdp["planned"]
        assert fsdp["planned"]["all_gather"][0] == 3 * 9 and fsdp["planned"]["reduce_scatter"][0] == 5
        assert gemini["kept"] == gemini["plan_window"] == 0
        assert gemini["grads"] == gemini["plan_summed"] > 0
        assert gemini["recorded"] == gemini["planned"]
        assert gemini["planned"]["all_reduce"][0] % 3 == 0 and gemini["planned"]["reduce_scatter"][0] % 3 == 0
