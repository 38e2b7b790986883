# SPDX-License-Identifier: Apache-2.0
"""Exact resume for every plugin and every kind of save point, in NEW processes, compared bitwise.

For ``single`` (1 process) and ``torch_ddp``, ``torch_fsdp``, ``gemini``, ``zero1``, ``zero2`` (2 gloo ranks), fp32,
AdamW, two schedulers, ``accumulative_counts=3``, a dropout layer (RNG restore), 8 iterations:

- launch 1 trains once without a save and once saving before any step (iteration 0), inside the first
  accumulation window (1: the optimizer has no state yet), on a window boundary (3) and mid-window (4);
- launch 2 (new processes) resumes each checkpoint into a Strategy built with another seed and other weights,
  and trains to the end.

Every run must give the reference's loss and learning-rate sequence (from its save point on), final parameters
and optimizer state bit for bit: a resumed window sums the saved gradients and the new ones in the order the
uninterrupted run does, on the same world size and plugin, so no tolerance is needed. The saving run must equal
the run without saves too: taking a checkpoint (even before the first step) never changes the training.

The 2-rank plugins share their launches (about 4 s of process start-up each on 2 cores): launch 1 runs every
plugin's first launch in turn, each in its own folder, and launch 2 (new processes) every plugin's resumes. A
plugin that raises is recorded with its traceback and fails only its own test.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _resume_cases import SAVES, resumed, uninterrupted

from stepforge.testing.distributed import requires_gloo, run_distributed

pytestmark = requires_gloo


def _plugins() -> list[str]:
    from stepforge.core import PLUGINS

    names = ["single", "torch_ddp", "torch_fsdp", "gemini"]
    for name in ("zero1", "zero2"):  # stepforge-zero, installed in the strategy test session
        try:
            PLUGINS.get(name)
        except Exception:
            continue
        names.append(name)
    return names


def _assert_same(got: dict, want: dict, what: str) -> None:
    assert got["losses"] == want["losses"], f"{what}: losses differ"
    assert got["lrs"] == want["lrs"], f"{what}: learning rates differ"
    assert got["params"].keys() == want["params"].keys(), f"{what}: parameter names differ"
    for key in want["params"]:
        assert torch.equal(got["params"][key], want["params"][key]), f"{what}: parameter {key} differs"
    assert got["optimizer"].keys() == want["optimizer"].keys(), (
        f"{what}: optimizer state entries differ: "
        f"{sorted(set(got['optimizer']) ^ set(want['optimizer']))[:6]}"
    )
    for key, value in want["optimizer"].items():
        other = got["optimizer"][key]
        same = torch.equal(other, value) if isinstance(value, torch.Tensor) else other == value
        assert same, f"{what}: optimizer entry {key} differs ({other!r} vs {value!r})"


def _each(launch: Callable[..., Any], rank: int, world_size: int, work: str, plugins: list[str]) -> dict:
    """``launch`` for every plugin in turn (each in ``work/<plugin>``); a failure is kept as its traceback."""
    out: dict[str, Any] = {}
    for plugin in plugins:
        try:
            out[plugin] = launch(rank, world_size, os.path.join(work, plugin), plugin)
        except Exception:
            out[plugin] = _Failed(traceback.format_exc())
    return out


class _Failed(str):
    """The traceback of a plugin whose launch raised on this rank."""


def _first_launches(rank: int, world_size: int, work: str, plugins: list[str]) -> dict:
    return _each(uninterrupted, rank, world_size, work, plugins)


def _second_launches(rank: int, world_size: int, work: str, plugins: list[str]) -> dict:
    return _each(resumed, rank, world_size, work, plugins)


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory) -> tuple[list[dict], list[dict]]:
    """Both launches of every 2-rank plugin: launch 2 in new processes, after launch 1 has ended."""
    plugins = [p for p in _plugins() if p != "single"]
    work = str(tmp_path_factory.mktemp("resume-matrix"))
    first = run_distributed(_first_launches, 2, work, plugins, timeout=120 * len(plugins))
    second = run_distributed(_second_launches, 2, work, plugins, timeout=120 * len(plugins))
    return first, second


def _runs(plugin: str, request: pytest.FixtureRequest, work: str) -> tuple[list, list]:
    if plugin == "single":
        first = run_distributed(uninterrupted, 1, work, plugin, timeout=240)
        return first, run_distributed(resumed, 1, work, plugin, timeout=240)
    first, second = request.getfixturevalue("two_rank_runs")
    for launch, name in ((first, "launch 1"), (second, "launch 2")):
        for rank, got in enumerate(launch):
            if isinstance(got[plugin], _Failed):
                pytest.fail(f"{plugin}: {name} raised on rank {rank}:\n{got[plugin]}")
    return [r[plugin] for r in first], [r[plugin] for r in second]


@pytest.mark.distributed
@pytest.mark.parametrize("plugin", _plugins())
def test_exact_resume_at_every_save_point(tmp_path, plugin, request):
    world = 1 if plugin == "single" else 2
    first, second = _runs(plugin, request, str(tmp_path))
    for rank in range(world):
        plain, saved = first[rank]["plain"], first[rank]["saved"]
        assert len(plain["losses"]) == 8 and plain["lrs"][0] != plain["lrs"][-1]  # the schedule moved
        _assert_same(saved, plain, f"rank {rank}: the run that saved vs the run without saves")
        for name, it in SAVES.items():
            got = second[rank][name]
            assert got["cur_iter"] == it
            want = dict(plain, losses=plain["losses"][it:], lrs=plain["lrs"][it:])
            _assert_same(got, want, f"rank {rank}: resumed from {name} (iteration {it})")
