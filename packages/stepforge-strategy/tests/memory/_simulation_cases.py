# SPDX-License-Identifier: Apache-2.0
"""The simulation at scale, case by case: each function runs in one fresh process (``run_isolated``) and plays
rank ``r`` of worlds of 8 to 1024 ranks on torch's fake process group, with the 1.3 B and 7 B GPT shapes built
on the meta device and given fake (storage-less) tensors: the real ZeRO and FSDP2 code builds its partitions,
reduces gradients and gathers parameters; every collective it calls is recorded. The functions return plain
numbers; the tests compare them with theory and with the plugins' memory plans.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any
from unittest import mock

import torch
from torch import nn

from stepforge.core.torch_compat import fake_tensor_mode
from stepforge.strategy.memory.gpt import GPT, GPT_SHAPES, GPTShape
from stepforge.testing.fake_world import CollectiveRecorder, fake_group, fake_parameters

MODELS = ("gpt-1.3b", "gpt-7b")
WORLDS = (8, 64, 256, 1024)
OPTIMIZER = dict(type="AdamW", lr=1e-4)
#: the inner optimizer of the ZeRO cases: the layout and collectives do not depend on it, and plain SGD is one
#: fake operation per piece (AdamW's step on fake tensors took seconds per case)
PLAIN_SGD = dict(type="SGD", lr=1e-2)


def _meta_models() -> dict[str, nn.Module]:
    with torch.device("meta"):
        return {name: GPT(GPT_SHAPES[name]) for name in MODELS}


def _tokens() -> torch.Tensor:
    return torch.zeros((1, 2), dtype=torch.int64)


def _plan_collectives(plan: Any) -> dict[str, tuple[int, int]]:
    out: dict[str, tuple[int, int]] = {}
    for c in plan.collectives:
        calls, nbytes = out.get(c.op, (0, 0))
        out[c.op] = (calls + c.calls, nbytes + c.nbytes)
    return out


def zero_cases(stage: int, cpu_offload: bool) -> list[dict[str, Any]]:
    """``LowLevelZeroPlugin(stage, precision="bf16", cpu_offload, overlap_allgather=True)`` at every world and
    shape, as rank 0, through one backward and one step: its pieces, buckets and collectives, with the plugin's
    plan for the same settings."""
    from stepforge.zero import LowLevelZeroPlugin

    warnings.filterwarnings("ignore")
    out = []
    models = _meta_models()
    for name, meta in models.items():
        for world in WORLDS:
            with fake_group(0, world):
                # the gather overlapped with the next forward: the step launches it (recorded) and returns; waiting
                # for it would copy every rank's piece of every parameter out of the table, one fake copy each
                # (minutes at 64 ranks), and no next forward runs here
                plugin = LowLevelZeroPlugin(
                    stage=stage, precision="bf16", cpu_offload=cpu_offload, overlap_allgather=True
                )
                plan = plugin.memory_plan(meta, world_size=world, optimizer=PLAIN_SGD, backend="fake")
                model = copy.deepcopy(meta)
                with fake_tensor_mode():
                    fake_parameters(model, torch.bfloat16)
                    inner = torch.optim.SGD(model.parameters(), lr=1e-2)
                    # the model is built in the working dtype: prepare's cast is the identity, which a fake
                    # tensor mode cannot apply to fake parameters (it would swap each for itself)
                    with mock.patch.object(nn.Module, "to", lambda self, *a, **k: self):
                        wrapped, optimizer = plugin.prepare(model, inner)
                    with CollectiveRecorder() as recorder:
                        optimizer.backward(wrapped(_tokens()).float().mean())
                        optimizer.step()
                    layout = optimizer.layout
                    out.append(
                        dict(
                            model=name,
                            world=world,
                            numels=[s.numel for s in layout.slots],
                            pieces=[s.piece for s in layout.slots],
                            valid=[s.valid for s in layout.slots],
                            master_bytes=sum(
                                s.master.numel() * s.master.element_size() for s in layout.slots
                            ),
                            master_device=str(layout.master_device),
                            grad_bytes=sum(s.grad.numel() * 4 for s in layout.slots if s.grad is not None),
                            reductions=optimizer.collective_counts.reductions,
                            bucket=optimizer.reduce_bucket_size,
                            algorithm=optimizer.comm_algorithm,
                            gather=optimizer.param_gather,
                            recorded=recorder.totals(),
                            planned=_plan_collectives(plan),
                            plan_grads=plan.total(component="grads", lifetimes=("step",)),
                            plan_master=plan.total(component="master"),
                        )
                    )
    return out


def zero_last_rank_layouts(worlds: tuple[int, ...]) -> dict[int, dict[str, Any]]:
    """The 7 B shape's pieces on the last rank of each world (the one whose pieces end short), from the real
    ``build_layout``."""
    from stepforge.zero.state.partition import build_layout

    meta = _meta_models()["gpt-7b"]
    out = {}
    for world in worlds:
        with fake_group(world - 1, world):
            params = [p.to(torch.bfloat16) for p in meta.parameters()]
            layout = build_layout(
                [{"params": params}], world, world - 1, group=None, master_weights=True, master_device=None
            )
        out[world] = dict(numels=[s.numel for s in layout.slots], valid=[s.valid for s in layout.slots])
    return out


def fsdp_cases(
    plugin_name: str, kwargs: dict[str, Any], compute: list[tuple[str, int]]
) -> list[dict[str, Any]]:
    """``plugin_name(precision="bf16", **kwargs)`` at every world and shape, as rank 0: each parameter's local
    shard, and for the ``compute`` (shape, world) pairs a forward and backward with every collective recorded;
    with the plugin's plan for the same settings."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from stepforge.core import PLUGINS

    warnings.filterwarnings("ignore")
    out = []
    models = _meta_models()
    for name, meta in models.items():
        for world in WORLDS:
            with fake_group(0, world):
                plugin = PLUGINS.get(plugin_name)(precision="bf16", device="cpu", **kwargs)
                plan = plugin.memory_plan(meta, world_size=world, optimizer=OPTIMIZER, device="cpu")
                # sharded on the meta device (the move to the CPU would copy out of meta tensors), then each
                # local shard given fake storage; the device mesh cannot be built inside a fake tensor mode
                with mock.patch.object(nn.Module, "to", lambda self, *a, **k: self):
                    wrapped, _ = plugin.prepare(copy.deepcopy(meta), None)
                with fake_tensor_mode():
                    wrapped.to_empty(device="cpu")
                    shards = {}
                    for fqn, p in wrapped.named_parameters():
                        local = p.to_local() if isinstance(p, DTensor) else p
                        shards[fqn] = (
                            tuple(p.shape),
                            tuple(local.shape),
                            local.untyped_storage().nbytes(),
                            str(local.device),
                            isinstance(p, DTensor) and p.device_mesh.size() == world,
                        )
                    case: dict[str, Any] = dict(
                        model=name,
                        world=world,
                        shards=shards,
                        units=sum(1 for m in wrapped.modules() if isinstance(m, FSDPModule)),
                        planned=_plan_collectives(plan),
                        plan_params=plan.total(component="params", lifetimes=("boost",)),
                        plan_state=plan.total(component="optimizer_state"),
                        recorded=None,
                    )
                    if (name, world) in compute:
                        optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-4, foreach=False)
                        with CollectiveRecorder() as recorder:
                            wrapped(_tokens()).float().mean().backward()
                        optimizer.step()
                        case["recorded"] = recorder.totals()
                        case["state_bytes"] = sum(
                            (v.to_local() if isinstance(v, DTensor) else v).untyped_storage().nbytes()
                            for st in optimizer.state.values()
                            for v in st.values()
                        )
                    out.append(case)
    return out


def real_shard_at_1024() -> dict[str, int]:
    """``torch_fsdp`` over 1024 ranks with this rank's shards really allocated (``to_empty``, no fake tensors):
    the bytes the process then holds for the 7 B model's parameters."""
    from torch.distributed.tensor import DTensor

    from stepforge.strategy.plugins import TorchFSDPPlugin

    warnings.filterwarnings("ignore")
    meta = _meta_models()["gpt-7b"]
    with fake_group(0, 1024):
        plugin = TorchFSDPPlugin(precision="bf16", device="cpu")
        plan = plugin.memory_plan(meta, world_size=1024, device="cpu")
        with mock.patch.object(nn.Module, "to", lambda self, *a, **k: self):  # stays on meta until to_empty
            wrapped, _ = plugin.prepare(meta, None)
        wrapped.to_empty(device="cpu")
        held = sum(
            p.to_local().untyped_storage().nbytes() for p in wrapped.parameters() if isinstance(p, DTensor)
        )
    return dict(held=held, planned=plan.total(component="params", lifetimes=("boost",)))


#: the measured-training cases' GPT: 31.6 M parameters, so that a rank of 1024 FSDP2 ranks still holds about
#: half a megabyte of state beside torch's few KiB of its own
TRAINED = GPTShape(layers=10, d_model=512, heads=8, vocab=256, context=128)


def trained_rank(plugin_name: str, world: int, rank: int) -> dict[str, int]:
    """``plugin_name`` (bf16, AdamW) trained two steps as ``rank`` of ``world`` on the fake group, its shards and
    buffers really allocated (the collectives move nothing, so the values are garbage): torch's ``MemTracker``
    over every allocation, what the rank holds after step 2's ``optimizer.step()`` and the peak over step 2;
    beside ``estimate`` of the same rank, made on fake tensors."""
    from stepforge.core.torch_compat import memory_tracker, tracker_bytes
    from stepforge.strategy import Booster, estimate

    warnings.filterwarnings("ignore")
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, TRAINED.vocab, (2, TRAINED.context), generator=gen)
    targets = torch.randint(0, TRAINED.vocab, (2, TRAINED.context), generator=gen)

    def loss_of(logits: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    optimizer = dict(type="AdamW", lr=1e-4)
    plugin = dict(type=plugin_name, precision="bf16")

    def total(kind: str) -> int:
        return tracker_bytes(tracker, kind)["cpu"]["Total"]

    est = estimate(
        lambda: GPT(TRAINED), plugin, world_size=world, rank=rank, optimizer=optimizer, inputs=tokens,
        criterion=loss_of, device="cpu", backend="fake",
    )  # fmt: skip
    held_components = ("params", "grads", "master", "optimizer_state", "buffers")
    with fake_group(rank, world):
        tracker = memory_tracker()
        with tracker:
            booster = Booster(plugin=plugin)
            model, opt, *_ = booster.boost(GPT(TRAINED), optimizer)
            booster.backward(loss_of(model(tokens)), opt)
            opt.step()
            opt.zero_grad()
            tracker.reset_mod_stats()
        with tracker:  # entering again starts the peak from here: step 2's
            booster.backward(loss_of(model(tokens)), opt)
            opt.step()
            held = total("current")
        peak = total("peak")
    est_held = sum(est.device[c] + est.host[c] for c in held_components)
    return dict(held=held, peak=peak, est_held=est_held, est_peak=est.peak(None))


class _Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.Parameter(0.1 * torch.randn(4, 64, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.experts.sum(0))


class PaddedNet(nn.Module):
    """Built like a ViT's position embedding and a MoE layer's experts: a ``(1, 32, 64)`` table in the root and
    two blocks of ``(4, 64, 64)`` experts. At 1024 ranks FSDP2 pads dimension 0 to one row per rank, so each
    all-gather output is 1024 times (the table) or 256 times (the experts) the parameters and sets the peak."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 64)
        self.table = nn.Parameter(0.1 * torch.randn(1, 32, 64))
        self.blocks = nn.ModuleList(_Experts() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x) + self.table[0, : x.shape[0]]
        for block in self.blocks:
            x = block(x)
        return x


def padded_units_rank(plugin_name: str, precision: str, world: int) -> dict[str, int]:
    """:class:`PaddedNet` under ``plugin_name`` (SGD) trained two steps as rank 0 of ``world`` on the fake group:
    the peak over step 2 (torch's ``MemTracker``) beside ``estimate``'s."""
    from stepforge.core.torch_compat import memory_tracker, tracker_bytes
    from stepforge.strategy import Booster, estimate

    warnings.filterwarnings("ignore")
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    plugin = dict(type=plugin_name, precision=precision)
    optimizer = dict(type="SGD", lr=1e-2)

    def loss_of(out: torch.Tensor) -> torch.Tensor:
        return out.float().square().mean()

    est = estimate(
        PaddedNet, plugin, world_size=world, optimizer=optimizer, inputs=x, criterion=loss_of, device="cpu",
        backend="fake",
    )  # fmt: skip
    with fake_group(0, world):
        booster = Booster(plugin=plugin)
        model, opt, *_ = booster.boost(PaddedNet(), optimizer)
        booster.backward(loss_of(model(x)), opt)
        opt.step()
        opt.zero_grad()
        tracker = memory_tracker()
        with tracker:
            booster.backward(loss_of(model(x)), opt)
            opt.step()
        peak = tracker_bytes(tracker, "peak")["cpu"]["Total"]
    return dict(peak=peak, est_peak=est.peak(None))


def dcp_reshards(
    runs: tuple[tuple[int, int, tuple[int, ...]], ...],
) -> dict[tuple[int, int], list[dict[str, Any]]]:
    """:func:`dcp_reshard` for each ``(save_world, load_world, load_ranks)``."""
    return {(save, load): dcp_reshard(save, load, ranks) for save, load, ranks in runs}


def dcp_reshard(save_world: int, load_world: int, load_ranks: tuple[int, ...]) -> list[dict[str, Any]]:
    """DCP's plans for one block of the 7 B shape and its embeddings (``Shard(0)`` DTensors, FSDP2's layout)
    saved by every rank of ``save_world`` and loaded by ``load_ranks`` of ``load_world``: no data is written.
    Returns, per loading rank and tensor, its local rows and the saved row ranges its read items cover."""
    from torch.distributed.checkpoint.default_planner import (
        create_default_global_save_plan,
        create_default_local_load_plan,
        create_default_local_save_plan,
    )

    meta = _meta_models()["gpt-7b"]
    names = ("tok.weight", "head.weight", *(f"blocks.0.{n}" for n, _ in meta.blocks[0].named_parameters()))
    shapes = {n: tuple(meta.get_parameter(n).shape) for n in names}
    plans = []
    for rank in range(save_world):
        with fake_group(rank, save_world):
            plans.append(create_default_local_save_plan(_sharded(shapes, save_world), rank == 0))
    _, metadata = create_default_global_save_plan(plans)
    out = []
    for rank in load_ranks:
        with fake_group(rank, load_world):
            state = _sharded(shapes, load_world)
            plan = create_default_local_load_plan(state, metadata)
            for fqn, tensor in state.items():
                # (row of the saved chunk read from, rows read, row of the local shard written)
                reads = [
                    (
                        item.storage_index.offset[0] + item.storage_offsets[0],
                        item.lengths[0],
                        item.dest_offsets[0],
                    )
                    for item in plan.items
                    if item.dest_index.fqn == fqn
                ]
                out.append(
                    dict(
                        rank=rank,
                        fqn=fqn,
                        rows=tensor.to_local().shape[0],
                        offset=_row_offset(shapes[fqn][0], load_world, rank),
                        saved_chunks=[
                            (c.offsets[0], c.sizes[0]) for c in metadata.state_dict_metadata[fqn].chunks
                        ],
                        reads=reads,
                    )
                )
    return out


def _row_offset(dim0: int, world: int, rank: int) -> int:
    return min(rank * -(-dim0 // world), dim0)


def _sharded(shapes: dict[str, tuple[int, ...]], world: int) -> dict[str, Any]:
    """``Shard(0)`` DTensors over the 1-D world mesh with ``torch.chunk``'s local rows (FSDP2's layout), their
    local shards on the meta device (DCP plans from shapes only)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    rank = dist.get_rank()
    out = {}
    for fqn, shape in shapes.items():
        rows = max(0, min(-(-shape[0] // world), shape[0] - rank * -(-shape[0] // world)))
        local = torch.empty((rows, *shape[1:]), dtype=torch.float32, device="meta")
        stride = torch.empty(shape, device="meta").stride()
        out[fqn] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)
    return out
