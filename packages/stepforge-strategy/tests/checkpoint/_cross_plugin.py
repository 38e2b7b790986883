# SPDX-License-Identifier: Apache-2.0
"""The cross-plugin resume matrix's launches (importable by spawned ranks; see test_cross_plugin_resume.py).

A save launch at world size W trains every plugin two steps (fp32, Adam) and saves it through the Booster
(model shards, optimizer ``shard=True`` and ``shard=False``) and through Strategy; rank 0 records the reference:
the full model and optimizer state the source holds, gathered by torch's own state-dict functions (or, for
ZeRO, by its gathered ``state_dict()``), never through the checkpoint code under test. A load launch builds each
target plugin fresh, loads a source's checkpoints and gathers its state the same independent way.
"""

from __future__ import annotations

import os
import traceback
import warnings
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

from stepforge.core import param_fqns, unwrap_optimizer
from stepforge.strategy import Booster, Strategy
from stepforge.strategy.boosted_model import ModelWrapper

PLUGINS = ["single", "torch_ddp", "torch_fsdp", "gemini", "zero1", "zero2", "zero2_offload"]
SIZES = (1, 2, 3, 4)
STEPS = 2


def sizes_of(plugin: str) -> tuple[int, ...]:
    return (1,) if plugin == "single" else SIZES


def pairs() -> list[tuple[str, int, str, int]]:
    """Every (source, its world size, target, its world size): each plugin meets every other one, and over its
    pairs each plugin is saved and loaded at every world size it supports (1 to 4)."""
    out = []
    for i, src in enumerate(PLUGINS):
        for j, dst in enumerate(PLUGINS):
            ws_src = 1 if src == "single" else 1 + (i + j) % 4
            ws_dst = 1 if dst == "single" else 1 + (i + 2 * j + 1) % 4
            out.append((src, ws_src, dst, ws_dst))
    return out


def plugin_cfg(name: str) -> Any:
    if name in ("single", "torch_ddp", "torch_fsdp"):
        return name
    if name == "zero2_offload":
        return dict(type="zero2", precision="fp32", cpu_offload=True)
    return dict(type=name, precision="fp32")


def make_model() -> nn.Module:
    # sizes no world size 2..4 divides: ZeRO's pieces start and end inside rows
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3), nn.Tanh(), nn.Linear(3, 2))


def _loss(model: nn.Module, step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(4, 5, generator=g), torch.randn(4, 2, generator=g)
    return (model(x) - y).square().mean()


def _module(plugin: str, model: Any) -> nn.Module:
    """The module torch's state-dict functions take: the Booster's model unwrapped, Strategy's as it is."""
    if plugin.startswith("zero"):
        return model.unwrap()  # LowLevelZeroModel (either path): the model it casts and wraps
    if isinstance(model, ModelWrapper):
        return model.unwrap(unwrap_peft=False)  # no peft here: importing it costs seconds
    return model


def full_state(plugin: str, model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """``{"model": {name: tensor}, "state": {name: {key: tensor}}, "groups": [...]}``, the full state gathered on
    every rank independently of stepforge's checkpoint code (collective)."""
    module = _module(plugin, model)
    options = StateDictOptions(full_state_dict=True, cpu_offload=False)
    weights = {k: v.detach().clone() for k, v in get_model_state_dict(module, options=options).items()}
    if plugin.startswith("zero"):
        full = optimizer.state_dict()  # ZeRO's own gathered form: keyed by index, in the parameters' shapes
        fqns = param_fqns(module)
        names = {s.index: fqns[s.param] for s in optimizer.layout.slots}
        state = {names[i]: entry for i, entry in full["state"].items()}
        groups = [{**g, "params": [names[i] for i in g["params"]]} for g in full["param_groups"]]
    else:
        full = get_optimizer_state_dict(module, unwrap_optimizer(optimizer), options=options)
        state, groups = full["state"], full["param_groups"]
    state = {
        n: {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in e.items()}
        for n, e in state.items()
    }
    return {"model": weights, "state": state, "groups": groups}


def _boost(plugin: str) -> tuple[Booster, nn.Module, Any]:
    booster = Booster(plugin=plugin_cfg(plugin))
    model = make_model()
    model, optimizer, *_ = booster.boost(model, torch.optim.Adam(model.parameters(), lr=0.1))
    return booster, model, optimizer


def _strategy(work: str, plugin: str) -> tuple[Strategy, nn.Module, Any]:
    s = Strategy(
        plugin=plugin_cfg(plugin),
        work_dir=work,
        experiment_name="cross",
        env_kwargs=dict(randomness=dict(seed=7)),
        log_kwargs=dict(console=False),
    )
    model, wrapper = s.prepare(make_model(), optim_wrapper=dict(optimizer=dict(type="Adam", lr=0.1)))
    return s, model, wrapper


def _save_one(rank: int, root: str, plugin: str) -> None:
    booster, model, opt = _boost(plugin)
    for step in range(STEPS):
        booster.backward(_loss(model, step, rank), opt)
        opt.step()
        opt.zero_grad()
    booster.save_model(model, os.path.join(root, "model"), shard=True)
    booster.save_optimizer(opt, os.path.join(root, "optim"), shard=True)
    booster.save_optimizer(opt, os.path.join(root, "optim.pt"), shard=False)
    ref = full_state(plugin, model, opt)
    if rank == 0:
        torch.save(ref, os.path.join(root, "reference.pt"))
    s, model, wrapper = _strategy(os.path.join(root, "strategy"), plugin)
    for step in range(STEPS):
        with wrapper.optim_context(model):
            loss = _loss(model, step, rank)
        wrapper.update_params(loss)
    s.save_checkpoint(os.path.join(root, "strategy.ckpt"))
    ref = full_state(plugin, model, wrapper.optimizer)
    if rank == 0:
        torch.save(ref, os.path.join(root, "strategy_reference.pt"))
    s.close()


def save_all(rank: int, world_size: int, root: str) -> dict[str, str]:
    """Save launch at ``world_size``: every plugin that runs at it, each under ``root/<plugin>@<W>``."""
    failed = {}
    for plugin in PLUGINS:
        if world_size in sizes_of(plugin):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # notes about slow CPU configurations
                    _save_one(rank, os.path.join(root, f"{plugin}@{world_size}"), plugin)
            except Exception:
                failed[plugin] = traceback.format_exc()
    return failed


def _load_one(rank: int, root: str, src: str, dst: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    booster, model, opt = _boost(dst)
    booster.load_model(model, os.path.join(root, "model"))
    booster.load_optimizer(opt, os.path.join(root, "optim"))
    out["booster"] = full_state(dst, model, opt)
    booster, model, opt = _boost(dst)
    booster.load_model(model, os.path.join(root, "model"))
    booster.load_optimizer(opt, os.path.join(root, "optim.pt"))
    out["booster_file"] = full_state(dst, model, opt)
    s, model, wrapper = _strategy(os.path.join(root, f"resumed-{dst}"), dst)
    s.resume(os.path.join(root, "strategy.ckpt"))
    out["strategy"] = full_state(dst, model, wrapper.optimizer)
    s.close()
    return out


def load_all(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Load launch at ``world_size``: every pair of :func:`pairs` whose target runs at it; rank 0's results (or
    the traceback) by ``"src@W->dst@W'"``."""
    out: dict[str, Any] = {}
    for src, ws_src, dst, ws_dst in pairs():
        if ws_dst != world_size:
            continue
        key = f"{src}@{ws_src}->{dst}@{ws_dst}"
        try:
            with warnings.catch_warnings():
                warnings.simplefilter(
                    "ignore"
                )  # notes about slow CPU configurations, the resume's seed notes
                got = _load_one(rank, os.path.join(root, f"{src}@{ws_src}"), src, dst)
        except Exception:
            got = traceback.format_exc()
        if rank == 0 or isinstance(got, str):
            out[key] = got
    return out
