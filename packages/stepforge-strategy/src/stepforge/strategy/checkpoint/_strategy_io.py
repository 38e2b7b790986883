# SPDX-License-Identifier: Apache-2.0
"""What a :class:`~stepforge.strategy.Strategy` checkpoint holds, and how it is saved, loaded and resumed.

The Strategy hands over a :class:`RunState` (the parts a checkpoint saves and restores): this module never
imports the Strategy, and it meets the plugin and the optimizer only through :class:`stepforge.core.Plugin`,
:class:`stepforge.core.BoostedOptimizer` and stepforge-accum's public ``OptimWrapper.window``.

DCP tensors (written by every rank, never gathered): ``model`` and ``optimizer`` from the plugin's
``get_state_dict`` pair. Shared objects (saved once): schedulers, the optim wrapper's accumulation counters and
``base_param_settings``, the loss-scaler state, shared registered statefuls, ``extra_ckpt``. Per-rank objects:
RNG states, per-rank registered statefuls, this rank's accumulation window (its local weight) and, when the
save falls inside an accumulation window, this rank's accumulated gradients.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor

from stepforge.accum import OptimWrapper
from stepforge.core import BoostedOptimizer, Plugin

from .._env import set_random_seed
from .._optim_template import complete_template
from .._version import __version__
from ._dcp import load_dir, read_dcp_metadata, read_meta, save_dir
from ._fsdp_window import fsdp_pending_grads, set_fsdp_pending_grads
from ._layout import CheckpointError, read_commit
from ._rng import get_rng_state, set_rng_state

__all__ = ["RunState", "save", "load", "resume"]

_OPTIM_ROOT = ("tensors", "optimizer")  # where save_dir puts the optimizer's state dict in the DCP tree


@dataclass
class RunState:
    """The parts of a run a checkpoint saves and restores, as the Strategy holds them.

    ``dispatch_kwargs`` is the Strategy's own dict (``resume`` sets its ``"cur_iter"``); ``optim_wrapper`` is
    the accumulation wrapper whose ``optimizer`` is the boosted optimizer.
    """

    model: torch.nn.Module | None
    optim_wrapper: OptimWrapper | None
    plugin: Plugin
    mixed_precision: str | None  # the Booster's mixed precision, for a plugin that does not own precision
    param_schedulers: list[Any] | None
    statefuls: dict[str, tuple[Any, bool]]
    dispatch_kwargs: dict[str, Any]
    seed: int
    experiment_name: str
    world_size: int
    rank: int
    work_dir: str
    deterministic: bool
    config: Any
    logger: logging.Logger


def _params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return list(model.parameters())


def _grads(model: torch.nn.Module) -> list[torch.Tensor | None]:
    out = []
    for p in _params(model):
        g = p.grad
        if isinstance(g, DTensor):
            g = g.to_local()
        out.append(None if g is None else g.detach().clone())
    return out


def _set_grads(model: torch.nn.Module, grads: Sequence[torch.Tensor | None]) -> None:
    params = _params(model)
    if len(params) != len(grads):
        raise CheckpointError(
            f"saved {len(grads)} accumulated gradients for a model with {len(params)} parameters"
        )
    for p, g in zip(params, grads, strict=True):
        if g is None:
            p.grad = None
        elif isinstance(p, DTensor):
            p.grad = DTensor.from_local(
                g.to(p.to_local().device), p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
            )
        else:
            p.grad = g.to(p.device)


def _boosted(wrapper: OptimWrapper) -> BoostedOptimizer:
    # RunState's contract: the wrapper's optimizer is the one the Booster boosted (Strategy.prepare did it)
    return cast(BoostedOptimizer, wrapper.optimizer)


def _json_safe(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return repr(value)


def save(
    run: RunState,
    filename: str,
    save_optimizer: bool,
    save_param_scheduler: bool,
    extra_ckpt: Mapping[str, Any] | None,
    callback: Any,
    max_keep_ckpts: int | None,
) -> str:
    if extra_ckpt is not None and not isinstance(extra_ckpt, Mapping):
        raise TypeError(
            f"save_checkpoint: extra_ckpt must be a dict or None, got {type(extra_ckpt).__name__}"
        )
    path = filename if os.path.isabs(filename) else os.path.join(run.work_dir, filename)
    model, wrapper, plugin = run.model, run.optim_wrapper, run.plugin
    assert model is not None, "Strategy.save_checkpoint checks that prepare() ran"
    window = wrapper.window if wrapper is not None else None
    mid_window = bool(window is not None and window.position)
    if mid_window:
        assert wrapper is not None and window is not None
        refusal = plugin.mid_window_save_error(wrapper.optimizer)
        if refusal is not None:
            raise ValueError(
                f"save_checkpoint: {window.position} micro-batch(es) of an accumulation window are not stepped "
                f"yet and plugin {plugin.name!r} cannot save them: {refusal}; save at a window boundary (every "
                f"accumulative_counts={window.counts} iterations)"
            )
    with_optim = save_optimizer and wrapper is not None
    msd, osd = plugin.get_state_dict(model, wrapper.optimizer if wrapper is not None and with_optim else [])
    if wrapper is not None and with_optim and not _boosted(wrapper).unwrap().state and "state" in osd:
        # never stepped: save no state (a plugin may have materialised a template's, e.g. ZeRO's pieces), so a
        # resume leaves the optimizer as fresh as it was and the first real step is step 1
        osd = {**osd, "state": {}}
    extra = dict(extra_ckpt or {})
    meta = {
        "iter": window.inner_count if window is not None else run.dispatch_kwargs.get("cur_iter", 0),
        "epoch": 0,
        "seed": run.seed,
        "experiment_name": run.experiment_name,
        "time": time.strftime("%Y%m%d_%H%M%S", time.localtime()),
        "stepforge_strategy": __version__,
        "torch": torch.__version__,
        "world_size": run.world_size,
        "plugin": plugin.name,
        "precision": plugin.precision or run.mixed_precision,
        "accumulative_counts": wrapper.accumulative_counts if wrapper is not None else 1,
        "mid_window": mid_window,
        "cfg": None if run.config is None else repr(run.config),
    }
    meta.update({k: _json_safe(v) for k, v in dict(extra.pop("meta", {}) or {}).items()})
    ckpt: dict[str, Any] = {"meta": meta, "state_dict": msd, **extra}
    if with_optim:
        ckpt["optimizer"] = osd
    if save_param_scheduler and run.param_schedulers:
        ckpt["param_schedulers"] = [s.state_dict() for s in run.param_schedulers]
    if callback is not None:
        callback(ckpt)
    meta = {k: _json_safe(v) for k, v in ckpt.pop("meta").items()}
    tensors = {"model": ckpt.pop("state_dict")}
    if "optimizer" in ckpt:
        tensors["optimizer"] = ckpt.pop("optimizer")
    shared: dict[str, Any] = {"extra": ckpt, "statefuls": {}}
    mine: dict[str, Any] = {"rng": get_rng_state(), "statefuls": {}}
    if with_optim:
        assert wrapper is not None and window is not None
        shared["accumulation"] = window.state_dict()
        mine["accumulation"] = window.state_dict()
        shared["base_param_settings"] = wrapper.base_param_settings
        shared["scaler"] = _boosted(wrapper).scaler_state_dict()
        if mid_window:
            mine["grads"] = _grads(model)
            mine["fsdp_pending_grads"] = fsdp_pending_grads(model)
    for name, (obj, per_rank) in run.statefuls.items():
        (mine if per_rank else shared)["statefuls"][name] = obj.state_dict()
    final = save_dir(
        path,
        tensors=tensors,
        objects=shared,
        rank_objects=mine,
        meta=meta,
        work_dir=run.work_dir,
        max_keep_ckpts=max_keep_ckpts,
    )
    run.logger.info(f"saved checkpoint {final} (iter {meta['iter']})")
    return final


def _map_location(run: RunState, map_location: Any) -> Any:
    if map_location == "default":
        return run.plugin.device
    return map_location


def _revise(keys: Sequence[str], revise_keys: Sequence[tuple[str, str]]) -> dict[str, str]:
    out = {}
    for key in keys:
        new = key
        for pattern, repl in revise_keys:
            new = re.sub(pattern, repl, new)
        out[new] = key
    return out


def load(
    run: RunState,
    filename: str,
    map_location: Any,
    strict: bool,
    revise_keys: Sequence[tuple[str, str]],
    callback: Any,
) -> dict[str, Any]:
    if run.model is None:
        raise RuntimeError("Strategy.load_checkpoint: call prepare(model) first")
    read_commit(filename)  # a clear error for an unfinished checkpoint before reading its metadata
    stored = read_dcp_metadata(filename).state_dict_metadata
    prefix = "tensors.model."
    saved_keys = [k[len(prefix) :] for k in stored if k.startswith(prefix)]
    revised = _revise(saved_keys, revise_keys)
    msd = get_model_state_dict(run.model)
    missing = sorted(set(msd) - set(revised))
    unexpected = sorted(set(revised) - set(msd))
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"load_checkpoint(strict=True): {filename!r} does not match the model: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]} (after revise_keys={list(revise_keys)})"
        )
    if missing or unexpected:
        run.logger.warning(f"load_checkpoint: missing keys {missing}, unexpected keys {unexpected}")
    template = {revised[k]: msd[k] for k in msd if k in revised}
    shared, _, meta = load_dir(filename, {"model": template}, map_location=map_location, rank_objects=False)
    assert shared is not None, "load_dir returns the objects when asked for them (the default)"
    ckpt = {"meta": meta, "state_dict": msd, **shared["extra"]}
    if callback is not None:
        callback(ckpt)
    set_model_state_dict(run.model, ckpt["state_dict"], options=StateDictOptions(strict=False))
    run.logger.info(f"loaded model weights from {filename}")
    return ckpt


def resume(
    run: RunState,
    filename: str,
    resume_optimizer: bool,
    resume_param_scheduler: bool,
    map_location: Any,
    callback: Any,
) -> dict[str, Any]:
    model, wrapper, plugin = run.model, run.optim_wrapper, run.plugin
    assert model is not None
    meta = read_meta(filename)
    same_world = meta.get("world_size") == run.world_size
    if meta.get("mid_window") and resume_optimizer and not same_world:
        raise CheckpointError(
            f"{filename!r} was saved inside an accumulation window at world size {meta.get('world_size')}; its "
            f"per-rank gradients cannot be mapped to world size {run.world_size}. Resume at world size "
            f"{meta.get('world_size')}, or from a checkpoint saved at a window boundary"
        )
    with_optim = resume_optimizer and wrapper is not None
    msd, osd = plugin.get_state_dict(model, wrapper.optimizer if wrapper is not None and with_optim else [])
    tensors = {"model": msd}
    if with_optim:
        tensors["optimizer"] = osd

    def exact_optimizer_template(template: dict[str, Any]) -> None:
        # run by load_dir once the files are verified: exactly the saved optimizer state entries (none for a
        # save before the first step), filled in place (``osd`` is ``template["optimizer"]``)
        if "optimizer" in template:
            assert wrapper is not None
            optimizer = _boosted(wrapper).unwrap()
            try:
                complete_template(template["optimizer"], filename, optimizer, root=_OPTIM_ROOT, prune=True)
            except ValueError as exc:
                raise CheckpointError(f"resume({filename!r}): {exc}") from exc

    shared, mine, meta = load_dir(
        filename, tensors, map_location=_map_location(run, map_location), complete=exact_optimizer_template
    )
    assert shared is not None, "load_dir returns the objects when asked for them (the default)"
    ckpt: dict[str, Any] = {"meta": meta, "state_dict": msd, **shared["extra"]}
    if with_optim:
        ckpt["optimizer"] = osd
    if callback is not None:
        callback(ckpt)
    if with_optim:
        assert wrapper is not None
        plugin.set_state_dict(model, wrapper.optimizer, ckpt["state_dict"], ckpt["optimizer"])
        window = wrapper.window
        acc = (mine or {}).get("accumulation") or shared.get("accumulation")
        if acc is not None:
            with warnings.catch_warnings():
                if mine is not None and mine.get("grads") is not None:  # restored below: the warning is moot
                    warnings.filterwarnings("ignore", message=".*middle of an accumulation window")
                window.load_state_dict(acc)
        if shared.get("base_param_settings") is not None:
            wrapper.base_param_settings = shared["base_param_settings"]
        _boosted(wrapper).load_scaler_state_dict(shared.get("scaler"))
        if mine is not None and mine.get("grads") is not None:
            _set_grads(model, mine["grads"])
            set_fsdp_pending_grads(model, mine.get("fsdp_pending_grads") or [])
    else:
        set_model_state_dict(model, ckpt["state_dict"], options=StateDictOptions(strict=False))
    if resume_param_scheduler and run.param_schedulers and "param_schedulers" in shared["extra"]:
        saved = shared["extra"]["param_schedulers"]
        if len(saved) != len(run.param_schedulers):
            raise CheckpointError(
                f"{filename!r} holds {len(saved)} param schedulers, this run has {len(run.param_schedulers)}"
            )
        for sched, state in zip(run.param_schedulers, saved, strict=True):
            sched.load_state_dict(state)
    for name, (obj, per_rank) in run.statefuls.items():
        source = (mine or {}).get("statefuls", {}) if per_rank else shared["statefuls"]
        if name in source:
            obj.load_state_dict(source[name])
        else:
            run.logger.warning(f"resume: no state for {name!r} in {filename} (world size changed?)")
    if meta.get("seed") != run.seed:
        warnings.warn(
            f"resume: the checkpoint's seed {meta.get('seed')} differs from this run's {run.seed}; "
            "the saved random states are restored",
            UserWarning,
            stacklevel=3,
        )
    if mine is not None:
        set_rng_state(mine["rng"])
    else:
        set_random_seed(int(meta["seed"]), run.deterministic, diff_rank_seed=True)
        run.logger.warning(
            f"resume: rank {run.rank} has no saved random state (saved at world size "
            f"{meta.get('world_size')}); re-seeded from the saved seed + rank"
        )
    run.dispatch_kwargs["cur_iter"] = meta.get("iter", 0)
    run.logger.info(f"resumed from {filename} at iter {meta.get('iter')}")
    return ckpt
