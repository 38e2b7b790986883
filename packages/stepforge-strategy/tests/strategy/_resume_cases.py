# SPDX-License-Identifier: Apache-2.0
"""The exact-resume matrix's two launches (importable by spawned ranks; see test_resume_matrix.py).

Launch 1 trains ``ITERS`` iterations twice in one process: once without any save (the reference) and once saving
at every iteration of :data:`SAVES`. Launch 2 (NEW processes) resumes each checkpoint in turn into a Strategy built
with another seed and other initial weights, and trains to ``ITERS``. Each run records, per iteration, the loss
and the learning rate after the schedulers stepped, and at the end the full parameters and this rank's optimizer
state (the plugin's own layout: per-rank shards compare like for like, as both runs have the same world size).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
from _strategy_cases import COUNTS, ITERS, batch, full_params, make_strategy, prepare
from torch.distributed.tensor import DTensor

from stepforge.core.flat_shard import FlatShard
from stepforge.strategy import Strategy

#: save points (COUNTS=3): before any step, inside the first window, on a window boundary, mid-window
SAVES = {"iter0": 0, "iter1": 1, "iter3": 3, "iter4": 4}
assert COUNTS == 3 and ITERS == 8, "SAVES names its positions for COUNTS=3, ITERS=8"


def plugin_cfg(name: str) -> Any:
    """The plugin argument for ``name``, all in fp32."""
    return name if name in ("single", "torch_ddp", "torch_fsdp") else dict(type=name, precision="fp32")


def _flat(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flat(f"{prefix}.{k}", v, out)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _flat(f"{prefix}.{i}", v, out)
    elif isinstance(value, DTensor):
        out[prefix] = value.to_local().detach().clone()
    elif isinstance(value, FlatShard):  # ZeRO's piece: its elements
        out[prefix] = value.local.detach().clone()
    elif isinstance(value, torch.Tensor):
        out[prefix] = value.detach().clone()
    else:
        out[prefix] = value


def optimizer_state(strategy: Strategy) -> dict[str, Any]:
    """This rank's optimizer state in the plugin's checkpoint layout, flattened (tensors cloned)."""
    _, wrapper, _ = strategy._components()
    _, osd = strategy.plugin.get_state_dict(strategy.model, wrapper.optimizer)
    out: dict[str, Any] = {}
    _flat("optimizer", osd, out)
    return out


def _train(strategy: Strategy, start: int, rank: int, saves: dict[int, str] | None = None) -> dict[str, Any]:
    model, wrapper, schedulers = strategy._components()
    model.train()
    losses, lrs = [], []
    for it in range(start, ITERS):
        if saves and it in saves:
            strategy.save_checkpoint(saves[it])
        x, y = batch(it, rank)
        with wrapper.optim_context(model):
            loss = (model(x) - y).square().mean()
        wrapper.update_params(loss)
        for s in schedulers:
            s.step()
        losses.append(loss.item())
        lrs.append(wrapper.param_groups[0]["lr"])
    return dict(losses=losses, lrs=lrs, params=full_params(model), optimizer=optimizer_state(strategy))


def uninterrupted(rank: int, world_size: int, work: str, plugin: str) -> dict[str, Any]:
    """Launch 1: the reference without saves, and the same run saving at every point of :data:`SAVES`."""
    ref = make_strategy(os.path.join(work, "reference"), plugin=plugin_cfg(plugin))
    prepare(ref)
    plain = _train(ref, 0, rank)
    ref.close()
    saving = make_strategy(work, plugin=plugin_cfg(plugin))
    prepare(saving)
    saved = _train(saving, 0, rank, saves={it: name for name, it in SAVES.items()})
    saving.close()
    return dict(plain=plain, saved=saved)


def resumed(rank: int, world_size: int, work: str, plugin: str) -> dict[str, Any]:
    """Launch 2: every checkpoint of :data:`SAVES` resumed (other seed, other weights) and trained to the end."""
    out = {}
    for name, it in SAVES.items():
        s = make_strategy(os.path.join(work, f"resumed-{name}"), plugin=plugin_cfg(plugin), seed=99)
        prepare(s, model_seed=5)
        torch.manual_seed(1234 + it)  # disturb the global RNG: resume must restore it (dropout)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="resume: the checkpoint's seed")
            s.resume(os.path.join(work, name))
        run = _train(s, it, rank)
        run["cur_iter"] = s.dispatch_kwargs["cur_iter"]
        out[name] = run
        s.close()
    return out
