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
"""

from __future__ import annotations

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


@pytest.mark.distributed
@pytest.mark.parametrize("plugin", _plugins())
def test_exact_resume_at_every_save_point(tmp_path, plugin):
    world = 1 if plugin == "single" else 2
    work = str(tmp_path)
    first = run_distributed(uninterrupted, world, work, plugin, timeout=240)
    second = run_distributed(resumed, world, work, plugin, timeout=240)
    for rank in range(world):
        plain, saved = first[rank]["plain"], first[rank]["saved"]
        assert len(plain["losses"]) == 8 and plain["lrs"][0] != plain["lrs"][-1]  # the schedule moved
        _assert_same(saved, plain, f"rank {rank}: the run that saved vs the run without saves")
        for name, it in SAVES.items():
            got = second[rank][name]
            assert got["cur_iter"] == it
            want = dict(plain, losses=plain["losses"][it:], lrs=plain["lrs"][it:])
            _assert_same(got, want, f"rank {rank}: resumed from {name} (iteration {it})")
