# SPDX-License-Identifier: Apache-2.0
"""Resume at another world size with ``Strategy(global_batch_size=12)``: 1 -> 2 -> 4 -> 2 -> 1 and 4 -> 3 -> 2.

Six launches, one per leg, each a NEW set of processes (1, 2, 4, 3, 2, 1 ranks), each running its leg for every
plugin in turn: resume the previous leg's checkpoint, train to the next optimizer step, save. At every world size
``accumulative_counts`` is re-derived (12, 6, 3, 4), every step consumes the next 12 samples of the epoch's order
and every save but one falls inside an epoch. Checked against explicit expectations, not the code under test:

- the ids drawn for each optimizer step are those of DistributedSampler's documented order (randperm seeded with
  seed + epoch), so every sample of every epoch is seen exactly once across the saves and size changes;
- after each resume: ``accumulative_counts``, ``cur_iter``, the window's iteration and step counters, the
  scheduler's clock, ``epoch_length`` and the loader's position in the new unit, and the lr of the schedule;
- the lr each step used, and the parameters after each leg, against plain torch on one process
  (:func:`_world_cases.reference`; close, not bitwise: the ranks sum the same gradients in another order).
"""

from __future__ import annotations

import traceback
from typing import Any

import pytest
import torch
from _world_cases import GAMMA, GLOBAL, LR, N, expected_ids, leg, reference

from stepforge.testing.distributed import requires_gloo, run_distributed

pytestmark = [requires_gloo, pytest.mark.distributed]

# (name, world size, resumed checkpoint, optimizer step trained to)
LEGS = [
    ("A", 1, None, 1),
    ("B", 2, "A", 2),
    ("C", 4, "B", 4),
    ("D", 3, "C", 5),
    ("E", 2, "C", 6),
    ("F", 2, "D", 7),
    ("G", 1, "E", 7),
]
STEP_OF = {name: until for name, _, _, until in LEGS}


def _plugins() -> list[str]:
    from stepforge.core import PLUGINS

    names = ["torch_ddp", "torch_fsdp"]
    try:  # stepforge-zero's ZeRO-2, when installed (the integrated tree's test session installs it)
        PLUGINS.get("zero2")
        names.append("zero2")
    except Exception:
        pass
    return names


class _Failed(str):
    """The traceback of a plugin's leg that raised on this rank."""


def _launch(rank: int, world_size: int, work: str, legs: list[tuple]) -> dict:
    out: dict[str, Any] = {}
    for plugin in _plugins():
        for name, _, source, until in legs:
            try:
                out[f"{plugin}/{name}"] = leg(
                    rank, world_size, f"{work}/{plugin}", plugin, source, until, name
                )
            except Exception:
                out[f"{plugin}/{name}"] = _Failed(traceback.format_exc())
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, list[dict]]:
    """Every leg's per-rank results, keyed ``plugin/leg``; the legs of one world size share a launch."""
    work = str(tmp_path_factory.mktemp("world-size"))
    out: dict[str, list[dict]] = {}
    launches = [[LEGS[0]], [LEGS[1]], [LEGS[2]], [LEGS[3]], [LEGS[4], LEGS[5]], [LEGS[6]]]
    for legs in launches:
        size = legs[0][1]
        per_rank = run_distributed(_launch, size, work, legs, timeout=60 + 30 * len(legs) * len(_plugins()))
        for key in per_rank[0]:
            out[key] = [r[key] for r in per_rank]
    return out


@pytest.fixture(scope="module")
def want() -> list[dict[str, torch.Tensor]]:
    return reference()


@pytest.mark.parametrize("plugin", _plugins())
def test_global_batch_data_counters_and_weights_continue_across_world_sizes(results, want, plugin):
    steps_per_epoch = N // GLOBAL
    for name, size, source, until in LEGS:
        per_rank = results[f"{plugin}/{name}"]
        for rank, got in enumerate(per_rank):
            if isinstance(got, _Failed):
                pytest.fail(f"{plugin}: leg {name} (world size {size}) raised on rank {rank}:\n{got}")
        counts = GLOBAL // size
        first = 0 if source is None else STEP_OF[source]
        # the samples of every step: this epoch's order, 12 at a time, whoever drew them
        for step in range(first, until):
            drawn = [
                i for r in per_rank for it in range(step * counts, (step + 1) * counts) for i in r["ids"][it]
            ]
            assert len(drawn) == GLOBAL and set(drawn) == expected_ids(step), f"{plugin} {name}: step {step}"
        assert all(len(r["ids"]) == (until - first) * counts for r in per_rank)
        assert per_rank[0]["lrs"] == [LR * GAMMA ** (k // steps_per_epoch) for k in range(first, until)]
        if source is not None:  # the counters after the resume, in this world size's unit
            epoch = (first * GLOBAL - 1) // N
            samples = first * GLOBAL - epoch * N
            for r in per_rank:
                assert r["resumed"] == dict(
                    counts=counts,
                    cur_iter=first * counts,
                    inner_count=first * counts,
                    steps=first,
                    sched_clock=first * counts,
                    epoch_length=N // size,
                    loader=dict(epoch=epoch, batches_yielded=samples // size, samples=samples),
                    lr=pytest.approx(LR * GAMMA ** (first // steps_per_epoch), rel=1e-12),
                ), f"{plugin} {name} resumed from {source}"
        params = per_rank[0]["params"]
        assert params.keys() == want[until - 1].keys()
        for key, value in want[until - 1].items():
            torch.testing.assert_close(params[key], value, rtol=1e-5, atol=1e-6, msg=f"{plugin} {name} {key}")
