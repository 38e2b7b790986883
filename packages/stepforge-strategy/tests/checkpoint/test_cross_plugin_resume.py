# SPDX-License-Identifier: Apache-2.0
"""Any plugin resumes any plugin's checkpoint at any world size, with the state exactly equal (fp32).

Plugins: ``single``, ``torch_ddp``, ``torch_fsdp``, ``gemini``, ``zero1``, ``zero2``, ``zero2`` with
``cpu_offload``. One gloo launch per world size 1-4 trains every plugin that runs there two Adam steps and saves it
through the Booster (model shards, optimizer ``shard=True`` and ``shard=False``) and through Strategy
(``save_checkpoint``); rank 0 records the reference: the full model and optimizer state the source holds, gathered
by torch's ``get_model_state_dict``/``get_optimizer_state_dict`` (ZeRO: its gathered ``state_dict()``), not by
the checkpoint code. One launch per world size then loads, for every (source, target) pair of
:func:`_cross_plugin.pairs` whose target runs at that size, the source's three checkpoints into a fresh target and
gathers its state the same way. Every model tensor, optimizer state entry and group option must equal the
reference bit for bit. Each plugin pair appears once, with world sizes chosen so that every plugin is a source and
a target at each of 1, 2, 3 and 4 (``single``: 1).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _cross_plugin import PLUGINS, SIZES, load_all, pairs, save_all, sizes_of

from stepforge.testing.distributed import requires_gloo, run_distributed

pytestmark = [pytest.mark.distributed, requires_gloo]

KINDS = {"booster": "reference.pt", "booster_file": "reference.pt", "strategy": "strategy_reference.pt"}


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> tuple[str, dict[str, str], dict[str, Any]]:
    root = str(tmp_path_factory.mktemp("cross-plugin"))
    save_failures: dict[str, str] = {}
    for ws in SIZES:
        for rank, failed in enumerate(run_distributed(save_all, ws, root, timeout=600)):
            save_failures.update({f"{p}@{ws} (rank {rank})": tb for p, tb in failed.items()})
    loads: dict[str, Any] = {}
    for ws in SIZES:
        for result in run_distributed(load_all, ws, root, timeout=600):
            for key, got in result.items():
                if key not in loads or isinstance(got, str):
                    loads[key] = got
    return root, save_failures, loads


def test_the_pairs_cover_every_plugin_pair_and_world_size():
    chosen = pairs()
    assert {(s, d) for s, _, d, _ in chosen} == {(s, d) for s in PLUGINS for d in PLUGINS}
    for plugin in PLUGINS:
        assert {ws for s, ws, _, _ in chosen if s == plugin} == set(sizes_of(plugin)), plugin
        assert {ws for _, _, d, ws in chosen if d == plugin} == set(sizes_of(plugin)), plugin
    assert any(ws_s != ws_d for _, ws_s, _, ws_d in chosen if ws_s == 3 or ws_d == 3)


def _same(got: Any, want: Any) -> bool:
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want)
    return bool(got == want)


def _check(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    assert got["model"].keys() == want["model"].keys(), f"{what}: model keys differ"
    for name, value in want["model"].items():
        assert _same(got["model"][name], value), f"{what}: model tensor {name} differs"
    assert want["state"], f"{what}: the reference holds no optimizer state (the source did not step?)"
    assert got["state"].keys() == want["state"].keys(), f"{what}: optimizer state names differ"
    for name, entry in want["state"].items():
        assert got["state"][name].keys() == entry.keys(), f"{what}: state keys of {name} differ"
        for key, value in entry.items():
            assert _same(got["state"][name][key], value), f"{what}: optimizer state {name}.{key} differs"
    assert got["groups"] == want["groups"], f"{what}: param groups differ"


@pytest.mark.parametrize("src", PLUGINS)
def test_an_unsharded_optimizer_save_is_one_file_of_the_full_state(matrix, src):
    root, save_failures, _ = matrix
    for ws in sizes_of(src):
        if any(k.startswith(f"{src}@{ws} ") for k in save_failures):
            continue  # reported by the test below
        want = torch.load(f"{root}/{src}@{ws}/reference.pt", weights_only=True)
        saved = torch.load(f"{root}/{src}@{ws}/optim.pt", weights_only=True)["optimizer"]
        names = [n for g in saved["param_groups"] for n in g["params"]]
        assert names == [n for g in want["groups"] for n in g["params"]], f"{src}@{ws}"
        got = {"model": want["model"], "state": saved["state"], "groups": saved["param_groups"]}
        _check(got, want, f"{src}@{ws} optim.pt")


@pytest.mark.parametrize("src", PLUGINS)
def test_every_plugin_loads_this_plugins_checkpoints_exactly(matrix, src):
    root, save_failures, loads = matrix
    broken = {k: v for k, v in save_failures.items() if k.startswith(f"{src}@")}
    assert not broken, "saving failed:\n" + "\n".join(f"{k}:\n{v}" for k, v in broken.items())
    for s, ws_src, dst, ws_dst in pairs():
        if s != src:
            continue
        key = f"{src}@{ws_src}->{dst}@{ws_dst}"
        got = loads[key]
        assert not isinstance(got, str), f"{key} raised:\n{got}"
        for kind, ref_file in KINDS.items():
            want = torch.load(f"{root}/{src}@{ws_src}/{ref_file}", weights_only=True)
            _check(got[kind], want, f"{key} ({kind})")
