# SPDX-License-Identifier: Apache-2.0
"""The memory plan of ``zero1``/``zero2`` (:meth:`LowLevelZeroPlugin.memory_plan`), from the code that allocates.

Nothing here restates the layout: the plan runs the optimizer's own code on meta tensors (no memory) and reads
what it built: :func:`~..state.partition.build_layout`'s pieces, a :class:`~..comm.grad_reducer.GradReducer` fed
one meta gradient per parameter in backward order through a :class:`RecordingWire` (its buckets, pooled buffers,
peak in flight and gradient pieces), the gather's own split (:func:`~..comm.param_gather.split_direct`), and the
state of the inner optimizer the plugin would build (``CPUAdam`` under offload), probed on the pieces' shapes.
Accumulating, ``no_sync`` leaves every full local gradient in ``param.grad`` (working dtype, on the device) until
the window's last backward, so the collectives are those of one backward.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch
from torch import nn

from stepforge.core.memory_plan import (
    MemoryPlan,
    add_optimizer_state,
    check_accumulation_steps,
    tensor_bytes,
    unique_parameters,
)

from ..comm.algorithm import bucket_size_for, comm_algorithm_for, param_gather_for
from ..comm.buffers import BufferPool
from ..comm.grad_reducer import GradReducer, WireFormat, _Pending
from ..comm.param_gather import DIRECT_MIN, GATHER_CHUNK, _chunks, split_direct
from ..config import LowLevelZeroConfig, cpu_adam_config
from ..state.partition import build_layout

__all__ = ["zero_memory_plan", "RecordingWire", "ZeroSettings"]


class ZeroSettings(Protocol):
    """What the plan reads of ``LowLevelZeroPlugin`` (which imports this module)."""

    name: str
    config: LowLevelZeroConfig

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...


_SCALE_BYTES = 4  # fp8 wire: a float32 scale travels behind each row


class RecordingWire(WireFormat):
    """A :class:`WireFormat` that records each bucket collective (op, payload bytes) instead of running it."""

    def __init__(self, wire: WireFormat) -> None:
        super().__init__(wire.dtype, wire.fp8)
        self.calls: list[tuple[str, int]] = []

    def _itemsize(self, tensor: torch.Tensor) -> int:
        dtype = self.dtype if self._cast(tensor) and self.dtype is not None else tensor.dtype
        return tensor_bytes(1, dtype)

    def reduce_scatter(
        self, out: torch.Tensor, flat: torch.Tensor, *, group: Any, world_size: int, async_op: bool
    ) -> Any:
        if self.fp8:  # fp8 bytes and a scale per row, by one all-to-all
            self.calls.append(("all_to_all", flat.numel() + world_size * _SCALE_BYTES))
        else:
            self.calls.append(("reduce_scatter", flat.numel() * self._itemsize(flat)))
        return _Pending(None, lambda: None) if async_op else None

    def exchange(
        self, received: torch.Tensor, rows: torch.Tensor, *, rank: int, group: Any, async_op: bool
    ) -> Any:
        # the payload of the all-to-all is every rank's row; this rank's own is neither sent nor copied
        self.calls.append(("all_to_all", (rows.shape[0] + 1) * rows.shape[1] * received.element_size()))
        return _Pending(None, lambda: None) if async_op else None

    def all_reduce(self, flat: torch.Tensor, *, group: Any, world_size: int, async_op: bool) -> Any:
        if self.fp8:  # every rank's fp8 bytes gathered, summed locally
            self.calls.append(("all_gather", world_size * (flat.numel() + _SCALE_BYTES)))
        else:
            self.calls.append(("all_reduce", flat.numel() * self._itemsize(flat)))
        return _Pending(None, lambda: None) if async_op else None


class _CountingPool(BufferPool):
    """The reducer's buffer pool, counting the bytes handed out (plus those held free) and their peak."""

    def __init__(self, keep: int, min_numel: int) -> None:
        super().__init__(keep, min_numel)
        self.out = 0
        self.peak = 0

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buffer = super().take(numel, dtype, device)
        self.out += buffer.numel() * buffer.element_size()
        self.peak = max(self.peak, self.out + self.held_bytes)
        return buffer

    def give(self, buffer: torch.Tensor) -> None:
        self.out -= buffer.numel() * buffer.element_size()
        super().give(buffer)


def zero_memory_plan(
    plugin: ZeroSettings,
    model: nn.Module,
    *,
    world_size: int,
    rank: int = 0,
    optimizer: Mapping[str, Any] | torch.optim.Optimizer | None = None,
    backend: str | None = None,
    device: str | torch.device | None = None,
    accumulation_steps: int = 1,
) -> MemoryPlan:
    """What one rank holds and communicates for ``model`` under this plugin's settings, from the optimizer's own
    partition and bucket code run on meta tensors; accumulating, the local gradients ``no_sync`` keeps through
    the window (``LowLevelZeroPlugin.memory_plan``; see this module's docstring)."""
    steps = check_accumulation_steps(accumulation_steps, f"{type(plugin).__name__}.memory_plan")
    on_cpu = torch.device(device if device is not None else plugin.device).type == "cpu"
    if backend is None:
        backend = "gloo" if on_cpu else "nccl"
    dtype = plugin.dtype
    offload = plugin.config.cpu_offload
    host_or_device = "host" if offload else "device"
    plan = MemoryPlan(
        plugin.name, world_size, rank, compute_dtype=dtype, offloads=offload, accumulation_steps=steps
    )
    bucket = plugin.config.reduce_bucket_size or bucket_size_for(
        backend, world_size, elsewhere=plugin.config.default_bucket_size
    )
    algorithm = comm_algorithm_for("auto", stage=plugin.config.stage, world_size=world_size, backend=backend)
    gather = param_gather_for(backend if world_size > 1 else None)
    plan.notes += [
        f"stage {plugin.config.stage}",
        f"bucket {bucket / 1024**2:g} Mi elements",
        algorithm,
        gather,
    ]

    # meta stand-ins of the trainable parameters, floating ones in the working dtype (as ``prepare`` casts)
    params = [
        nn.Parameter(torch.empty(p.shape, dtype=dtype if p.is_floating_point() else p.dtype, device="meta"))
        for _, p in unique_parameters(model)
        if p.requires_grad
    ]
    layout = build_layout(
        [{"params": params}],
        world_size,
        rank,
        group=None,
        master_weights=plugin.config.master_weights,
        master_device=None,
    )
    slots = layout.slots
    plan.add(
        "params",
        "device",
        sum(s.numel * s.param.element_size() for s in slots),
        f"{dtype} working parameters",
    )
    buffers = sum(
        tensor_bytes(b.numel(), dtype if b.is_floating_point() else b.dtype) for b in model.buffers()
    )
    plan.add("buffers", "device", buffers, "model buffers")
    # offload from an accelerator copies every piece to the CPU (a master of its own, whatever the dtype); on a
    # CPU device an fp32 piece stays a view of its parameter, as build_layout decides
    masters = [s for s in slots if s.valid and (s.separate_master or (offload and not on_cpu))]
    plan.add(
        "master",
        host_or_device,
        sum(s.valid * s.master.element_size() for s in masters),
        "fp32 master pieces",
    )
    padding = sum(s.piece - s.valid for s in slots)
    plan.notes.append(f"padding {padding} elements (this rank's pieces)")

    # the reducer over one backward's gradients (backward order) and the step's sync, recording
    wire = RecordingWire(WireFormat(plugin.config.communication_dtype, plugin.config.fp8_communication))
    reducer = GradReducer(
        slots, stage=plugin.config.stage, bucket_size=bucket, overlap=plugin.config.overlap_communication, group=None,
        world_size=world_size, rank=rank, wire=wire, algorithm=algorithm,
    )  # fmt: skip
    reducer.remove_hooks()  # the plan feeds the gradients itself
    reducer.pool = pool = _CountingPool(reducer.pool.keep, reducer.pool.min_numel)
    for slot in reversed(slots):  # backward reaches the last parameters first
        reducer._add(slot, torch.empty(slot.param.shape, dtype=slot.param.dtype, device="meta"))
    reducer.sync()
    plan.add("grads", host_or_device, reducer.pieces.held_bytes, "reduced gradient pieces", "step")
    plan.add("buffers", "device", pool.held_bytes, "gradient bucket buffers (kept)", "step")
    plan.add("buffers", "device", max(0, pool.peak - pool.held_bytes), "gradient buckets in flight", "reduce")
    # gradients wait in the filling bucket (working dtype) until it is launched
    waiting = min(bucket, sum(s.numel for s in slots)) * tensor_bytes(1, dtype)
    plan.add("grads", "device", waiting, "gradients waiting in a bucket", "reduce")
    totals: dict[str, tuple[int, int]] = {}
    for op, nbytes in wire.calls:
        calls, size = totals.get(op, (0, 0))
        totals[op] = (calls + 1, size + nbytes)
    for op, (calls, size) in totals.items():  # no_sync: the window's last backward reduces the sum, once
        plan.collective(op, "backward", calls, size, world_size, "gradient buckets")
    plan.notes.append(f"{reducer.counter.reductions} bucket reductions")
    if steps > 1:  # no_sync: hooks leave param.grad alone through the window
        local = sum(s.numel for s in slots) * tensor_bytes(1, dtype)
        plan.add("grads", "device", local, "local gradients (no_sync)", "window")
        plan.notes.append(f"{steps} micro-batches per step, reduced once (no_sync)")

    if world_size > 1:  # the parameter gather after the step: launch_gather's collectives and tables
        chunk = GATHER_CHUNK if plugin.config.overlap_allgather else None
        calls = staged_calls = 0
        payload = staged_payload = kept = fresh = 0
        for part in layout.partitions:
            itemsize = tensor_bytes(1, part.dtype)
            if gather == "broadcast":
                direct, staged = split_direct(part.slots, DIRECT_MIN)
                for slot in direct:  # one broadcast per rank holding a piece, in place
                    calls += sum(1 for r in range(world_size) if r * slot.piece < slot.numel)
                    payload += slot.numel * itemsize
                for run in _chunks(staged, chunk):  # a kept table of every rank's padded pieces
                    size = sum(s.piece for s in run)
                    staged_calls += world_size
                    staged_payload += world_size * size * itemsize
                    kept += world_size * size * itemsize
            else:
                for run in _chunks(part.slots, chunk):  # a fresh table and a copy of this rank's row
                    size = sum(s.piece for s in run)
                    staged_calls += 1
                    staged_payload += world_size * size * itemsize
                    fresh += (world_size + 1) * size * itemsize
        plan.collective("broadcast", "step", calls, payload, world_size, "updated pieces, in place")
        op = "broadcast" if gather == "broadcast" else "all_gather"
        plan.collective(op, "step", staged_calls, staged_payload, world_size, "updated pieces, staged")
        plan.add("buffers", "device", kept, "parameter gather tables (kept)", "step")
        plan.add("buffers", "device", fresh, "parameter gather table", "update")

    if optimizer is not None:
        config = optimizer  # an instance is the optimizer the plugin keeps (only a config becomes CPUAdam)
        if offload and isinstance(optimizer, Mapping):
            config = cpu_adam_config(optimizer) or optimizer
        stepped = [((s.valid,), s.master.dtype) for s in slots if s.valid > 0]
        add_optimizer_state(plan, config, stepped, place=host_or_device)
    return plan
