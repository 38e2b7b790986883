# SPDX-License-Identifier: Apache-2.0
"""At 8, 64, 256 and 1024 ranks (torch's fake process group, one process per plugin), for the 1.3 B and 7 B GPT
shapes, the real ZeRO and FSDP2 code shards as theory says, calls the collectives theory says with the bytes
theory says, and the plugins' memory plans agree with both; DCP's load plan reshards a save from 8 ranks to 1024
and back. The cases run in ``_simulation_cases``; here the expected values are written out from the layout
rules (``torch.chunk`` pieces of ``ceil(n / N)``, buckets launched once they reach the bucket size)."""

from __future__ import annotations

import _simulation_cases as cases
import pytest

from stepforge.testing.fake_world import run_isolated

BF16, FP32 = 2, 4
ZERO_BUCKET = 12 * 1024**2  # the plugin's bucket on a non-gloo backend (ColossalAI's 12 Mi elements)
GATHER_CHUNK = 1 << 22  # per-rank elements of one overlapped gather


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _buckets(numels: list[int], world: int) -> int:
    """Buckets launched over one backward: gradients arrive last parameter first, each adds its padded piece
    times the world size, a bucket launches once it holds at least the bucket size; the rest launches at the end."""
    launched, filled = 0, 0
    for n in reversed(numels):
        filled += _ceil(n, world) * world
        if filled >= ZERO_BUCKET:
            launched, filled = launched + 1, 0
    return launched + (1 if filled else 0)


def _gather_chunks(pieces: list[int]) -> int:
    chunks, size = 0, 0
    for piece in pieces:
        if chunks == 0 or size + piece > GATHER_CHUNK:
            chunks, size = chunks + 1, 0
        size += piece
    return chunks


@pytest.mark.parametrize(
    ("stage", "cpu_offload"), [(1, False), (2, False), (2, True)], ids=["zero1", "zero2", "zero2-offload"]
)
def test_zero_shards_buckets_and_collectives_at_scale(stage: int, cpu_offload: bool) -> None:
    """ZeRO at every world size: rank 0's pieces are ``ceil(n / N)`` of every parameter, its fp32 masters and
    gradient pieces hold exactly those elements, the backward launches the theoretical number of buckets, and the
    reduction and the parameter gather move ``N * ceil(n / N)`` elements per parameter: as recorded from the
    collectives the plugin called, and as the plugin's plan says."""
    results = run_isolated(cases.zero_cases, stage, cpu_offload, timeout=600)
    assert [(r["model"], r["world"]) for r in results] == [(m, w) for m in cases.MODELS for w in cases.WORLDS]
    for r in results:
        world, numels = r["world"], r["numels"]
        pieces = [_ceil(n, world) for n in numels]
        assert r["pieces"] == pieces
        assert r["valid"] == [min(p, n) for p, n in zip(pieces, numels, strict=True)]  # rank 0: never padding
        stepped = sum(r["valid"])
        assert r["master_bytes"] == stepped * FP32 == r["plan_master"]
        assert r["master_device"] == "cpu"
        assert r["grad_bytes"] == stepped * FP32 == r["plan_grads"]
        assert r["bucket"] == ZERO_BUCKET
        assert r["reductions"] == _buckets(numels, world)
        padded = sum(pieces) * world * BF16
        reduce_op = "all_reduce" if stage == 1 else "reduce_scatter"
        reduce_bytes = sum(numels) * BF16 if stage == 1 else padded  # an all-reduce moves the bucket unpadded
        expected = {
            reduce_op: (r["reductions"], reduce_bytes),
            "all_gather": (_gather_chunks(pieces), padded),
        }
        assert r["algorithm"] == reduce_op
        assert r["recorded"] == expected, (r["model"], world)
        assert r["planned"] == expected, (r["model"], world)


def test_zero_last_rank_piece() -> None:
    """The last of ``N`` ranks holds ``n - (N - 1) * ceil(n / N)`` elements of each parameter (none where the
    pieces ran out first); the other ranks' pieces carry that difference as padding on the wire. Every 7 B
    parameter divides evenly by 1024 (no padding there); at 768 ranks some do not."""
    layouts = run_isolated(cases.zero_last_rank_layouts, (768, 1024), timeout=120)
    for world, r in layouts.items():
        short = 0
        for n, valid in zip(r["numels"], r["valid"], strict=True):
            assert valid == max(0, n - (world - 1) * _ceil(n, world))
            short += valid < _ceil(n, world)
        assert (short > 0) == (world == 768)


def _layers(model: str) -> int:
    return {"gpt-1.3b": 24, "gpt-7b": 32}[model]


def _rest(shape: tuple[int, ...]) -> int:
    out = 1
    for s in shape[1:]:
        out *= s
    return out


def test_fsdp_shards_and_collectives_at_scale() -> None:
    """``torch_fsdp`` (FSDP2) at every world size: one unit per block plus the root; each parameter's local
    shard on rank 0 is ``torch.chunk``'s first piece of dimension 0, stored padded to ``ceil(dim0 / N)`` rows,
    and the plan's parameter bytes equal that storage; every unit all-gathers once in forward, every block again
    in backward, every unit reduce-scatters once its padded fp32 gradients; for the 1.3 B shape at 8 ranks and the
    7 B shape at 1024 ranks a forward and backward calls exactly those collectives (count and bytes, as
    recorded) and the optimizer state equals the plan."""
    results = run_isolated(
        cases.fsdp_cases, "torch_fsdp", {}, [("gpt-1.3b", 8), ("gpt-7b", 1024)], timeout=600
    )
    assert [(r["model"], r["world"]) for r in results] == [(m, w) for m in cases.MODELS for w in cases.WORLDS]
    for r in results:
        world, units = r["world"], _layers(r["model"]) + 1
        assert r["units"] == units
        padded = 0
        for fqn, (shape, local, nbytes, _, whole_world) in r["shards"].items():
            rows = _ceil(shape[0], world)
            assert whole_world, fqn
            assert local == (min(rows, shape[0]), *shape[1:]), fqn
            assert nbytes == rows * _rest(shape) * FP32, fqn
            padded += rows * _rest(shape)
        assert padded * FP32 == r["plan_params"]
        gathered = r["planned"]["all_gather"]
        assert gathered[0] == 2 * units - 1
        assert r["planned"]["reduce_scatter"] == (units, padded * world * FP32)
        assert "all_reduce" not in r["planned"]
        if r["recorded"] is not None:
            assert r["recorded"] == r["planned"], (r["model"], world)
            assert r["state_bytes"] == r["plan_state"]
    assert sum(r["recorded"] is not None for r in results) == 2


def test_gemini_placement_at_scale() -> None:
    """``gemini`` with ``shard_param_frac=0.75``, ``offload_optim_frac=0.25``: the trailing blocks holding the
    last quarter of the bytes are replicated (whole on every rank, their gradients all-reduced: one all-reduce
    per replicated block in the plan), the others sharded ``ceil(dim0 / N)`` rows; at 8 and 1024 ranks a
    forward and backward calls exactly the plan's collectives and the optimizer state equals the plan."""
    results = run_isolated(
        cases.fsdp_cases,
        "gemini",
        dict(shard_param_frac=0.75, offload_optim_frac=0.25),
        [("gpt-1.3b", 8), ("gpt-7b", 1024)],
        timeout=600,
    )
    for r in results:
        world, layers = r["world"], _layers(r["model"])
        blocks = {int(fqn.split(".")[1]) for fqn in r["shards"] if fqn.startswith("blocks.")}
        replicated = {
            int(fqn.split(".")[1])
            for fqn, (shape, local, *_) in r["shards"].items()
            if fqn.startswith("blocks.") and local == shape
        }
        assert replicated == set(range(layers - len(replicated), layers)) and 0 < len(replicated) < layers
        total = sum(shape[0] * _rest(shape) for shape, *_ in r["shards"].values())
        per_block = sum(
            shape[0] * _rest(shape) for fqn, (shape, *_) in r["shards"].items() if fqn.startswith("blocks.0.")
        )
        # units are taken from the front until they hold 3/4 of the bytes: the rest is under a quarter
        assert len(replicated) * per_block <= 0.25 * total < (len(replicated) + 1) * per_block
        for fqn, (shape, local, *_) in r["shards"].items():
            block = int(fqn.split(".")[1]) if fqn.startswith("blocks.") else None
            shards = 1 if block in replicated else world
            assert local[0] == min(_ceil(shape[0], shards), shape[0]), fqn
        assert blocks == set(range(layers))
        assert r["planned"]["all_reduce"][0] == len(replicated)
        if r["recorded"] is not None:
            assert r["recorded"] == r["planned"], (r["model"], world)
            assert r["state_bytes"] == r["plan_state"]


def test_only_the_shard_is_allocated_at_1024_ranks() -> None:
    """FSDP2 over 1024 ranks, its shards allocated for real (``to_empty``, no fake tensors): the 7 B model's
    parameters take the planned 26.8 MB on this rank, 1/1024 of the model plus padding."""
    r = run_isolated(cases.real_shard_at_1024, timeout=300)
    assert r["held"] == r["planned"]
    assert r["held"] < 6_864_642_048 * FP32 / 1024 * 1.01


@pytest.mark.parametrize("plugin", ["zero2", "torch_fsdp"])
def test_the_estimate_of_a_rank_of_1024_is_what_it_allocates_training(plugin: str) -> None:
    """Rank 0 and the last rank of 1024 trained for two steps on the fake group with a 31.6 M GPT (bf16, AdamW),
    every buffer really allocated: what each holds after the step is the estimate within 3% and its peak within
    10% (the last rank's shards end short, so it holds less: 0.47 MB against 0.77 MB under FSDP2)."""
    results = {rank: run_isolated(cases.trained_rank, plugin, 1024, rank, timeout=300) for rank in (0, 1023)}
    for rank, r in results.items():
        assert abs(r["est_held"] / r["held"] - 1) <= 0.03, (rank, r)
        assert abs(r["est_peak"] / r["peak"] - 1) <= 0.10, (rank, r)
    if plugin == "torch_fsdp":
        assert results[1023]["held"] < 0.7 * results[0]["held"]
        assert results[1023]["est_held"] < 0.7 * results[0]["est_held"]


@pytest.mark.parametrize(("plugin", "precision"), [("torch_fsdp", "fp32"), ("gemini", "bf16")])
def test_the_peak_follows_all_gather_outputs_padded_to_the_world(plugin: str, precision: str) -> None:
    """At 1024 ranks FSDP2 pads a ``(1, 32, 64)`` table and ``(4, 64, 64)`` experts to one row per rank: the peak
    is set by all-gather outputs (the root's still held while the first block is copied out in forward; a
    block's own beside the reduce-scatter input of the block reduced before it in backward), not by
    activations. The estimate is within 5% of the measured peak (it was 0.72 and 0.78 before it counted those
    two moments), at 8 ranks too."""
    results = run_isolated(cases.padded_units_rank, plugin, precision, 1024, timeout=300)
    assert abs(results["est_peak"] / results["peak"] - 1) <= 0.05, results
    small = run_isolated(cases.padded_units_rank, plugin, precision, 8, timeout=300)
    assert abs(small["est_peak"] / small["peak"] - 1) <= 0.05, small
    assert results["peak"] > 4 * small["peak"]  # the padding, not the model, sets the 1024-rank peak


def test_dcp_load_plan_reshards() -> None:
    """DCP's load plan for a save at 8 ranks read back at 1024 (ranks 0 and 1023), and for a save at 1024 read back
    at 8 (ranks 0 and 7), no data written: each loading rank's local rows are covered exactly once, in order, by
    reads from the saved chunks that overlap them, none crossing a chunk's end."""
    runs = ((8, 1024, (0, 1023)), (1024, 8, (0, 7)))
    plans = run_isolated(cases.dcp_reshards, runs, timeout=300)
    for save, load, ranks in runs:
        results = plans[(save, load)]
        assert {r["rank"] for r in results} == set(ranks)
        for r in results:
            start, rows = r["offset"], r["rows"]
            covered = start
            for source, length, dest in sorted(r["reads"], key=lambda x: x[2]):
                assert dest == covered - start and source == covered
                chunk = next(c for c in r["saved_chunks"] if c[0] <= source < c[0] + c[1])
                assert source + length <= chunk[0] + chunk[1]
                covered += length
            assert covered == start + rows, r["fqn"]
            overlapping = [
                c for c in r["saved_chunks"] if c[1] and c[0] < start + rows and c[0] + c[1] > start
            ]
            assert len(r["reads"]) == len(overlapping)
        # a 1024-way save read at 8 ranks: rank 0 reads many chunks, each whole
        if save == 1024:
            assert max(len(r["reads"]) for r in results) > 100
