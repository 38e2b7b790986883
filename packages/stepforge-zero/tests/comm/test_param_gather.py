# SPDX-License-Identifier: Apache-2.0
"""``stepforge.zero.comm.param_gather``: the gather in flight waited per module by the next forward
(``overlap_allgather``), ``LowLevelZeroOptimizer(overlap_allgather=True)`` equal to the waited gather, and
ColossalAI's ``_force_wait_all_gather()`` (optimizer and prepared model) landing it before a raw read.

The per-module waiting is checked with recording stand-ins for the collectives' work objects (which waits
happen, in which order, is then deterministic); the distributed part checks on 2 gloo ranks that every forward
output, parameter and optimizer state of an overlapped run is bit-identical to the run that waits in ``step``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from stepforge.testing.distributed import requires_gloo, run_distributed
from stepforge.testing.fake_world import fake_group, run_isolated
from stepforge.zero.comm.param_gather import DIRECT_MIN, GatherInFlight, StagingBuffers, _Entry, launch_gather
from stepforge.zero.low_level import LowLevelZeroOptimizer
from stepforge.zero.plugin import LowLevelZeroPlugin
from stepforge.zero.plugin.model import LowLevelZeroModel
from stepforge.zero.state.partition import build_layout


class _RecordingWork:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def wait(self) -> bool:
        self.log.append(self.name)
        return True


def _flight(model: nn.Sequential, log: list[str]) -> GatherInFlight:
    flight = GatherInFlight()
    for i, layer in enumerate(model):
        params = list(layer.parameters(recurse=False))
        if params:
            flight.add(_Entry([_RecordingWork(log, f"layer{i}")], params))
    return flight


def test_each_module_waits_for_its_own_parameters_only_and_the_hook_goes_once_all_arrived():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    log: list[str] = []
    flight = _flight(model, log)
    flight.wait_in_forward()
    assert flight.waiting_in_forward
    model[0](torch.ones(1, 3))
    assert log == ["layer0"]  # layer 2's collective is not waited for yet
    model(torch.ones(1, 3))
    assert log == ["layer0", "layer2"] and flight.done
    assert not flight.waiting_in_forward  # removed: later forwards pay nothing
    model(torch.ones(1, 3))
    assert log == ["layer0", "layer2"]


def test_wait_all_waits_in_launch_order_once_and_runs_the_copy_out():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    log: list[str] = []
    flight = _flight(model, log)
    copied: list[int] = []
    flight.add(_Entry([_RecordingWork(log, "staged")], [], then=lambda: copied.append(1)))
    flight.wait_in_forward()
    flight.wait_all()
    flight.wait_all()
    assert log == ["layer0", "layer1", "staged"] and copied == [1]
    assert not flight.waiting_in_forward


class _Gathering:
    """Stands in for the optimizer bound to a prepared model: counts the waits asked of it."""

    def __init__(self) -> None:
        self.waits = 0

    def wait_for_param_gather(self) -> None:
        self.waits += 1


def test_the_prepared_model_waits_before_its_weights_are_read_or_loaded():
    wrapped = LowLevelZeroModel(nn.Linear(2, 2), torch.float32, "fp32", torch.device("cpu"))
    optimizer = _Gathering()
    wrapped.bind_optimizer(optimizer)
    state = wrapped.state_dict()
    assert optimizer.waits == 1
    wrapped.load_state_dict(state)
    assert optimizer.waits == 2
    assert wrapped.unwrap() is wrapped.module and optimizer.waits == 3


def test_one_rank_copies_the_masters_into_the_parameters_and_keeps_no_table():
    # bf16 working parameters with fp32 masters: the "gather" casts the updated masters back
    params = [
        nn.Parameter(torch.zeros(3, 4, dtype=torch.bfloat16)),
        nn.Parameter(torch.zeros(5, dtype=torch.bfloat16)),
    ]
    layout = build_layout([{"params": params}], 1, 0, group=None, master_weights=True, master_device=None)
    staging = StagingBuffers()
    for slot, value in zip(layout.slots, (1.5, -2.25), strict=True):
        slot.master.copy_(torch.arange(slot.numel, dtype=torch.float32) * value)
    flight = launch_gather(layout, "broadcast", staging=staging)
    assert flight.done and staging.held_bytes == 0
    assert torch.equal(params[0].detach(), (torch.arange(12.0) * 1.5).view(3, 4).to(torch.bfloat16))
    assert torch.equal(params[1].detach(), (torch.arange(5.0) * -2.25).to(torch.bfloat16))


def _gather_twice(rank: int, world: int, dtype: torch.dtype) -> dict:
    # 3 x 4 (pieces of 6), 5 (pieces of 3, the last rank's padded) and a transposed 3 x 2 (not contiguous): all
    # below DIRECT_MIN, staged into one table. fp32: the contiguous masters are views into the parameters (this
    # rank's piece is not copied back); bf16: separate fp32 masters
    params = [
        nn.Parameter(torch.zeros(3, 4, dtype=dtype)),
        nn.Parameter(torch.zeros(5, dtype=dtype)),
        nn.Parameter(torch.zeros(2, 3, dtype=dtype).t()),
    ]
    layout = build_layout(
        [{"params": params}], world, rank, group=None, master_weights=True, master_device=None
    )
    staging = StagingBuffers()
    out: dict = {"params": [], "pointers": [], "held": []}
    for step in range(2):
        for slot in layout.slots:  # each rank's elements: their index in the flat parameter + 100 * step
            slot.master.copy_(
                torch.arange(slot.start, slot.start + slot.valid, dtype=torch.float32) + 100 * step
            )
        launch_gather(layout, "broadcast", staging=staging).wait_all()
        out["params"].append([p.detach().float().clone() for p in params])
        out["pointers"].append(staging.table((0, 0), world, 6 + 3 + 3, layout.partitions[0]).data_ptr())
        out["held"].append(staging.held_bytes)
    return out


@pytest.mark.distributed
@requires_gloo
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_staged_broadcast_table_is_kept_between_gathers_and_carries_each_gathers_values(dtype):
    size = torch.finfo(dtype).bits // 8
    for result in run_distributed(_gather_twice, 2, dtype, timeout=60):
        for step, (weight, bias, transposed) in enumerate(result["params"]):
            assert torch.equal(weight, torch.arange(12.0).view(3, 4) + 100 * step)
            assert torch.equal(bias, torch.arange(5.0) + 100 * step)
            # a non-contiguous parameter is sharded by its flattened (row-major) values
            assert torch.equal(transposed, torch.arange(6.0).view(3, 2) + 100 * step)
        assert (
            result["pointers"][0] == result["pointers"][1]
        )  # the second gather reused the first one's table
        assert result["held"] == [2 * 12 * size, 2 * 12 * size]  # one (2, 12) table, kept


def test_a_staging_table_is_made_zero_filled_and_remade_when_its_chunk_changes_size():
    layout = build_layout(
        [{"params": [nn.Parameter(torch.ones(4))]}], 1, 0, group=None, master_weights=True, master_device=None
    )
    part = layout.partitions[0]
    staging = StagingBuffers()
    first = staging.table((0, 0), 2, 3, part)
    assert first.shape == (2, 3) and first.dtype == torch.float32 and not first.any()
    first.fill_(7.0)
    assert staging.table((0, 0), 2, 3, part) is first
    other = staging.table((0, 0), 2, 5, part)
    assert other.shape == (2, 5) and not other.any()
    assert staging.held_bytes == 2 * 5 * 4


# -- 2 gloo ranks: overlapped == waited, bit for bit ---------------------------------------------------------
def _model(dtype: torch.dtype) -> nn.Sequential:
    torch.manual_seed(0)
    # 1024 x 1024 weights: one parameter at DIRECT_MIN (broadcast in place), the rest staged
    model = nn.Sequential(
        nn.Linear(16, 1024), nn.Tanh(), nn.Linear(1024, 1024), nn.Tanh(), nn.Linear(1024, 4)
    )
    assert model[2].weight.numel() >= DIRECT_MIN
    return model.to(dtype)


def _train(rank: int, dtype: torch.dtype, overlap: bool, method: str, stage: int) -> dict:
    model = _model(dtype)
    opt = LowLevelZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        stage=stage,
        overlap_allgather=overlap,
        param_gather=method,
        overlap_communication=True,
        reduce_bucket_size=4096,
    )
    outputs = []
    for step in range(4):
        gen = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(8, 16, generator=gen).to(dtype)
        y = torch.randn(8, 4, generator=gen)
        out = model(x)  # right after the previous step: an overlapped gather is waited for per layer
        outputs.append(out.detach().float().clone())
        opt.backward(((out.float() - y) ** 2).mean())
        opt.step()
        if step == 2:
            opt.step()  # a second step on the same gradients, with no forward in between: waits first
        opt.zero_grad()
    state = opt.state_dict()  # waits for the last gather (no forward after the last step)
    return {
        "outputs": outputs,
        "params": [p.detach().float().clone() for p in model.parameters()],
        "state": [v.clone() for s in state["state"].values() for k, v in sorted(s.items()) if k != "step"],
    }


CASES = [
    ("broadcast", torch.float32, 2),
    ("broadcast", torch.bfloat16, 2),
    ("all_gather", torch.float32, 1),
    ("all_gather", torch.bfloat16, 2),
]


PLUGIN = ("plugin", torch.float32, 2)


def _plugin_train(rank: int, overlap: bool) -> dict:
    """Through the plugin: the prepared model's state dict read right after a step (it waits for the gather)."""
    plugin = LowLevelZeroPlugin(stage=2, precision="fp32", overlap_allgather=overlap)
    model = _model(torch.float32)
    wrapped, opt = plugin.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    assert opt is not None
    for step in range(3):
        gen = torch.Generator().manual_seed(100 * step + rank)
        loss = ((wrapped(torch.randn(8, 16, generator=gen)) - torch.randn(8, 4, generator=gen)) ** 2).mean()
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
    return {"params": [v.clone() for v in wrapped.state_dict().values()], "outputs": [], "state": []}


def _both(rank: int, world: int) -> list[tuple[dict, dict]]:
    pairs = [
        (_train(rank, dtype, False, method, stage), _train(rank, dtype, True, method, stage))
        for method, dtype, stage in CASES
    ]
    return [*pairs, (_plugin_train(rank, False), _plugin_train(rank, True))]


@pytest.mark.distributed
@requires_gloo
def test_overlapped_gather_equals_the_waited_gather_bitwise_on_two_ranks():
    results = run_distributed(_both, 2, timeout=180)
    for rank, cases in enumerate(results):
        for (method, dtype, stage), (waited, overlapped) in zip([*CASES, PLUGIN], cases, strict=True):
            where = (rank, method, dtype, stage)
            for key in ("outputs", "params", "state"):
                assert len(waited[key]) == len(overlapped[key]), where
                assert waited[key] or (method == "plugin" and key != "params"), where
                for a, b in zip(waited[key], overlapped[key], strict=True):
                    assert torch.equal(a, b), (where, key)
    # the ranks agree (the gather reached everyone), and training moved the weights
    for a, b in zip(results[0][0][1]["params"], results[1][0][1]["params"], strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(results[0][0][1]["params"][0], _model(torch.float32)[0].weight.detach())


def _colossalai_force_wait(rank: int, world: int) -> dict:
    """ColossalAI's pattern (its tests and checkpoint IO): a step with ``overlap_allgather``, then
    ``_force_wait_all_gather()`` on the optimizer or the prepared model, then the raw working parameters read
    with no forward in between."""

    def one_step(model: nn.Module, opt: LowLevelZeroOptimizer, run: nn.Module) -> None:
        gen = torch.Generator().manual_seed(7 + rank)
        opt.backward(
            ((run(torch.randn(8, 16, generator=gen)) - torch.randn(8, 4, generator=gen)) ** 2).mean()
        )
        opt.step()

    out: dict = {}
    for overlap in (False, True):
        model = _model(torch.float32)
        opt = LowLevelZeroOptimizer(
            torch.optim.AdamW(model.parameters(), lr=1e-2), stage=2, overlap_allgather=overlap,
            overlap_communication=True, param_gather="broadcast",
        )  # fmt: skip
        one_step(model, opt, model)
        out[f"stale_{overlap}"] = [p.detach().clone() for p in model.parameters()]
        opt._force_wait_all_gather()
        out[overlap] = [p.detach().clone() for p in model.parameters()]
    plugin = LowLevelZeroPlugin(stage=2, precision="fp32", overlap_allgather=True)
    model = _model(torch.float32)
    wrapped, opt = plugin.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    assert isinstance(opt, LowLevelZeroOptimizer)
    one_step(model, opt, wrapped)
    wrapped._force_wait_all_gather()
    out["plugin"] = [p.detach().clone() for p in model.parameters()]
    return out


@pytest.mark.distributed
@requires_gloo
def test_force_wait_all_gather_lands_the_overlapped_gather_as_colossalai_calls_it():
    for rank, out in enumerate(run_distributed(_colossalai_force_wait, 2, timeout=120)):
        waited = out[False]
        # overlapped: after the step the staged parameters still hold the other rank's old pieces ...
        assert any(not torch.equal(a, b) for a, b in zip(out["stale_True"], waited, strict=True)), rank
        # ... and after _force_wait_all_gather every parameter is the waited run's, on the optimizer and the model
        for a, b in zip(out[True], waited, strict=True):
            assert torch.equal(a, b), rank
        for a, b in zip(out["plugin"], waited, strict=True):
            assert torch.equal(a, b), rank
        assert all(torch.equal(a, b) for a, b in zip(out["stale_False"], waited, strict=True)), rank


class _CountCopies(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.copies += func is torch.ops.aten.copy_.default
        return func(*args, **(kwargs or {}))


def _copy_out_at(world: int, rank: int) -> dict:
    """Rank ``rank`` of ``world`` (fake group: the broadcasts move nothing). Every other rank's row of the staged
    table is filled beforehand with what that rank would send: element ``j`` of the piece of rank ``src`` holds
    its flat index ``src * piece + j`` plus ``1000 * parameter``; this rank's own row is staged from its masters
    holding the same numbers. Returns the parameters after the copy-out and the copies it took."""
    params = [
        nn.Parameter(torch.zeros(40, 70)),  # 2800: pieces of 3 at 1024 ranks, the 934th short, the rest empty
        nn.Parameter(torch.zeros(2 * world)),  # whole pieces on every rank
        nn.Parameter(torch.zeros(5)),  # fewer elements than ranks
        nn.Parameter(torch.zeros(3, 7).t()),  # not contiguous: sharded by its row-major values
    ]
    with fake_group(rank, world):
        layout = build_layout(
            [{"params": params}], world, rank, group=None, master_weights=True, master_device=None
        )
        staging = StagingBuffers()
        size = sum(slot.piece for slot in layout.slots)
        table = staging.table((0, 0), world, size, layout.partitions[0])
        for i, slot in enumerate(layout.slots):
            index = torch.arange(world * slot.piece, dtype=torch.float32).view(world, slot.piece)
            table[:, slot.offset : slot.offset + slot.piece] = index + 1000 * i
            slot.master.copy_(torch.arange(slot.start, slot.start + slot.valid) + 1000.0 * i)
        flight = launch_gather(layout, "broadcast", staging=staging)
        with _CountCopies() as counter:
            flight.wait_all()
    return dict(params=[p.detach().clone() for p in params], copies=counter.copies)


@pytest.mark.parametrize("world", [5, 1024])
def test_the_copy_out_puts_every_ranks_piece_in_place_in_a_few_copies_per_parameter(world):
    """However many ranks, the staged table goes into each parameter in a few copies (the whole pieces before and
    after this rank's own as one strided copy each, a last short piece as another): not one per rank, which at
    1024 ranks was hundreds of thousands of copies a step for a GPT."""
    result = run_isolated(_copy_out_at, world, 3, timeout=120)
    weight, bias, small, transposed = result["params"]
    assert torch.equal(weight, torch.arange(2800.0).view(40, 70))
    assert torch.equal(bias, torch.arange(2.0 * world) + 1000)
    assert torch.equal(small, torch.arange(5.0) + 2000)
    assert torch.equal(transposed, (torch.arange(21.0) + 3000).view(7, 3))
    # fp32 masters are views into the parameters: this rank's own piece is never copied back; 3 contiguous
    # parameters with at most 3 copies each, the transposed one in 1
    assert result["copies"] <= 3 * 3 + 1
