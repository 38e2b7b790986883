# SPDX-License-Identifier: Apache-2.0
"""What a :class:`~stepforge.strategy.Strategy` checkpoint holds, and how it is saved, loaded and resumed.

The Strategy hands over a :class:`RunState` (the parts a checkpoint saves and restores): this module never
imports the Strategy, and it meets the plugin and the optimizer only through :class:`stepforge.core.Plugin`,
:class:`stepforge.core.BoostedOptimizer` and stepforge-accum's public ``OptimWrapper.window``.

DCP tensors (written by every rank, never gathered): ``model`` and ``optimizer`` from the plugin's
``get_state_dict`` pair. Shared objects (saved once): schedulers, the optim wrapper's accumulation counters and
``base_param_settings``, the loss-scaler state, shared registered statefuls, ``extra_ckpt``. Per-rank objects:
RNG states (python, numpy, torch CPU, every CUDA device), per-rank registered statefuls, this rank's
accumulation window (its local weight) and, when the save falls inside an accumulation window, this rank's
accumulated gradients.

Loads verify, then apply. Phase 1 touches nothing live: the commit marker and every file's CRC-32, the plugin
and world size recorded in the meta, the model's keys, shapes and dtypes, the optimizer's groups, parameters and
state layout (:func:`~stepforge.strategy.checkpoint._optim_template.fit_template`), then every object blob and
every tensor is read into fresh tensors, and the scheduler list, accumulation state, saved gradients and RNG
states are checked against the live run. Only then, phase 2 applies them: weights and optimizer
(``Plugin.set_state_dict``, its lr included), accumulation window, scaler, gradients, schedulers, statefuls, RNG,
iteration. Any failure of phase 1 raises :class:`CheckpointError` naming the file and the difference, with the
run exactly as it was. Gradients after a successful resume are as the checkpoint says: saved inside an
accumulation window, this rank's window gradients come back; saved at a window boundary, every ``.grad`` is
``None`` (as the uninterrupted run has them after its step).
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.distributed.tensor import DTensor

from stepforge.accum import OptimWrapper
from stepforge.core import BoostedOptimizer, Plugin, unwrap_optimizer

from .._env import set_random_seed
from .._version import __version__
from ._dcp import check_template, read_dcp_metadata, read_dir, save_dir
from ._fsdp_window import fsdp_pending_grads, set_fsdp_pending_grads
from ._layout import CheckpointError, CheckpointMismatchError, verify_dir
from ._optim_template import fit_template, saved_optimizer_state
from ._rescale import iteration_scale

__all__ = [
    "RunState",
    "get_rng_state",
    "load_checkpoint",
    "resume_checkpoint",
    "save_checkpoint",
    "set_rng_state",
]


@dataclass
class RunState:
    """The parts of a run a checkpoint saves and restores, as the Strategy holds them.

    ``dispatch_kwargs`` is the Strategy's own dict (``resume`` sets its ``"cur_iter"``; its
    ``"train_micro_batch_size_per_gpu"`` gives the global batch); ``optim_wrapper`` is the accumulation wrapper
    whose ``optimizer`` is the boosted optimizer.
    """

    model: torch.nn.Module | None
    optim_wrapper: OptimWrapper | None
    plugin: Plugin
    mixed_precision: str | None  # the Booster's mixed precision, for a plugin that does not own precision
    param_schedulers: list[Any] | None
    statefuls: dict[str, tuple[Any, bool]]
    dispatch_kwargs: dict[str, Any]
    seed: int
    global_batch_size: int | None  # the run's Strategy(global_batch_size=...): kept across world sizes
    experiment_name: str
    world_size: int
    rank: int
    work_dir: str
    deterministic: bool
    config: Any
    logger: logging.Logger


def get_rng_state() -> dict[str, Any]:
    """The state of every generator this process uses, as values ``torch.load(weights_only=True)`` reads."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        # as plain values and a tensor, so the checkpoint loads under torch.load(weights_only=True)
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = (
            kind,
            torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            int(pos),
            int(has_gauss),
            float(cached),
        )
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore :func:`get_rng_state`'s output (generators absent from it, or from this process, are left alone)."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"].cpu())
    if "numpy" in state:
        try:
            import numpy as np
        except ImportError:
            pass
        else:
            kind, keys, pos, has_gauss, cached = state["numpy"]
            if isinstance(keys, torch.Tensor):
                # resume's default map_location is the plugin's device: on a GPU the keys arrive on cuda
                keys = keys.cpu().numpy().astype(np.uint32)
            np.random.set_state((kind, keys, pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        saved = state["cuda"]
        if len(saved) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([s.cpu() for s in saved])


def _json_safe(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return repr(value)


def _epoch(run: RunState, iteration: int) -> int | None:
    """The epoch a save falls in: ``dispatch_kwargs['epoch']`` when the loop sets it (an mmengine runner passes
    its own in ``extra_ckpt['meta']``, which wins), else ``iteration // epoch_length``; None when neither is
    known (an iteration-based run without ``epoch_length``)."""
    given = run.dispatch_kwargs.get("epoch")
    if isinstance(given, int) and not isinstance(given, bool):
        return given
    length = run.dispatch_kwargs.get("epoch_length")
    if isinstance(length, int) and not isinstance(length, bool) and length > 0:
        return int(iteration) // length
    return None


def _global_batch(run: RunState, counts: int) -> int | None:
    """Samples per optimizer step over all ranks, when the micro-batch size is known."""
    micro = run.dispatch_kwargs.get("train_micro_batch_size_per_gpu")
    if isinstance(micro, int) and not isinstance(micro, bool) and micro > 0:
        return run.world_size * micro * counts
    return run.global_batch_size


def save_checkpoint(
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
    if not isinstance(filename, str | os.PathLike) or not os.fspath(filename).strip():
        raise ValueError(
            f"save_checkpoint: filename must be a non-empty name or path such as 'iter_100', got {filename!r}"
        )
    filename = os.fspath(filename)
    path = filename if os.path.isabs(filename) else os.path.join(run.work_dir, filename)
    model, wrapper, plugin = run.model, run.optim_wrapper, run.plugin
    assert model is not None, "Strategy.save_checkpoint checks that prepare() ran"
    window = wrapper.window if wrapper is not None else None
    mid_window = bool(window is not None and window.position)
    if wrapper is not None and window is not None and mid_window:
        refusal = plugin.mid_window_save_refusal(wrapper.optimizer)
        if refusal is not None:
            raise ValueError(
                f"save_checkpoint: {window.position} micro-batch(es) of an accumulation window are not stepped "
                f"yet and plugin {plugin.name!r} cannot save them: {refusal}; save at a window boundary (every "
                f"accumulative_counts={window.counts} iterations)"
            )
    saving = wrapper if save_optimizer else None  # the optim wrapper whose optimizer this save holds
    msd, osd = plugin.get_state_dict(model, saving.optimizer if saving is not None else [])
    extra = dict(extra_ckpt or {})
    iteration = window.inner_count if window is not None else run.dispatch_kwargs.get("cur_iter", 0)
    counts = wrapper.accumulative_counts if wrapper is not None else 1
    meta = {
        "iter": iteration,
        "epoch": _epoch(run, iteration),
        "seed": run.seed,
        "experiment_name": run.experiment_name,
        "time": time.strftime("%Y%m%d_%H%M%S", time.localtime()),
        "stepforge_strategy": __version__,
        "torch": torch.__version__,
        "world_size": run.world_size,
        "plugin": plugin.name,
        "precision": plugin.precision or run.mixed_precision,
        "accumulative_counts": counts,
        "global_batch_size": _global_batch(run, counts),
        "mid_window": mid_window,
        "cfg": None if run.config is None else repr(run.config),
    }
    meta.update({k: _json_safe(v) for k, v in dict(extra.pop("meta", {}) or {}).items()})
    ckpt: dict[str, Any] = {"meta": meta, "state_dict": msd, **extra}
    if saving is not None:
        ckpt["optimizer"] = saved_optimizer_state(saving.optimizer, osd)
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
    if saving is not None:
        shared["accumulation"] = saving.window.state_dict()
        mine["accumulation"] = saving.window.state_dict()
        shared["base_param_settings"] = saving.base_param_settings
        shared["scaler"] = cast(BoostedOptimizer, saving.optimizer).scaler_state_dict()
        if mid_window:  # this rank's accumulated gradients (local shards), copied
            grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in model.parameters()]
            mine["grads"] = [None if g is None else g.detach().clone() for g in grads]
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


def load_checkpoint(
    run: RunState,
    filename: str,
    map_location: Any,
    strict: bool,
    revise_keys: Sequence[tuple[str, str]],
    callback: Any,
) -> dict[str, Any]:
    if run.model is None:
        raise RuntimeError("Strategy.load_checkpoint: call prepare(model) first")
    meta = verify_dir(filename)["meta"]  # type: ignore[index]  # an unfinished or damaged one: a clear error
    stored = read_dcp_metadata(filename).state_dict_metadata
    prefix = "tensors.model."
    saved_keys = [k[len(prefix) :] for k in stored if k.startswith(prefix)]
    revised = {}  # revised key -> saved key
    for key in saved_keys:
        new = key
        for pattern, repl in revise_keys:
            new = re.sub(pattern, repl, new)
        revised[new] = key
    # the plugin's layout (the keys its saves use), not the wrapper's own state_dict
    msd, _ = run.plugin.get_state_dict(run.model, [])
    missing = sorted(set(msd) - set(revised))
    unexpected = sorted(set(revised) - set(msd))
    if strict and (missing or unexpected):
        raise CheckpointMismatchError(
            f"load_checkpoint(strict=True): {filename!r} does not match the model: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]} (after revise_keys={list(revise_keys)})"
        )
    if missing or unexpected:
        run.logger.warning(f"load_checkpoint: missing keys {missing}, unexpected keys {unexpected}")
    template = {revised[k]: msd[k] for k in msd if k in revised}
    fresh, shared, _ = read_dir(filename, {"model": template}, map_location=map_location)
    loaded = {k: fresh["model"][revised[k]] for k in msd if k in revised}
    ckpt = {"meta": meta, "state_dict": loaded, **shared.get("extra", {})}
    if callback is not None:
        callback(ckpt)
    _set_weights(run, run.model, ckpt["state_dict"])
    run.logger.info(f"loaded model weights from {filename}")
    return ckpt


def _set_weights(run: RunState, model: torch.nn.Module, weights: Mapping[str, Any]) -> None:
    """New weights without the optimizer's state, through the plugin's pair; then the plugin refreshes what it
    derives from them (a ZeRO plugin's fp32 masters), or the next ``step()`` would write the old weights back."""
    current, _ = run.plugin.get_state_dict(model, [])
    run.plugin.set_state_dict(model, [], {**current, **weights}, {})
    optimizers = [] if run.optim_wrapper is None else [run.optim_wrapper.optimizer]
    run.plugin.after_model_load(model, optimizers)


def _note_global_batch(run: RunState, meta: Mapping[str, Any]) -> None:
    """Warn when a resume at another world size changes the global batch (nothing keeps it)."""
    saved = meta.get("global_batch_size")
    micro = run.dispatch_kwargs.get("train_micro_batch_size_per_gpu")
    wrapper = run.optim_wrapper
    if (
        saved is None
        or wrapper is None
        or not isinstance(micro, int)
        or meta.get("world_size") == run.world_size
    ):
        return
    now = run.world_size * micro * wrapper.accumulative_counts
    if now != saved:
        run.logger.warning(
            f"resume: the global batch changes from {saved} (world size {meta.get('world_size')}) to {now} "
            f"(world size {run.world_size}); pass Strategy(global_batch_size={saved}) to keep it"
        )


def _check_objects(
    run: RunState,
    filename: str,
    shared: Mapping[str, Any],
    mine: Mapping[str, Any] | None,
    resume_sched: bool,
) -> None:
    """The saved objects fit the live run (phase 1: nothing is applied yet)."""
    model = run.model
    assert model is not None
    extra = shared.get("extra", {})
    if resume_sched and run.param_schedulers and "param_schedulers" in extra:
        saved = extra["param_schedulers"]
        if not isinstance(saved, list) or len(saved) != len(run.param_schedulers):
            count = len(saved) if isinstance(saved, list) else type(saved).__name__
            raise CheckpointMismatchError(
                f"{filename!r} holds {count} param schedulers, this run has {len(run.param_schedulers)}"
            )
        for i, (sched, state) in enumerate(zip(run.param_schedulers, saved, strict=True)):
            live = set(sched.state_dict())
            if not isinstance(state, dict) or set(state) != live:
                theirs = sorted(state) if isinstance(state, dict) else type(state).__name__
                raise CheckpointMismatchError(
                    f"{filename!r}: param scheduler {i} was saved with entries {theirs}, this run's "
                    f"{type(sched).__name__} has {sorted(live)} (another scheduler type)"
                )
    if mine is not None:
        if not isinstance(mine.get("rng"), dict) or "python" not in mine["rng"] or "torch" not in mine["rng"]:
            raise CheckpointError(f"{filename!r}: this rank's random states are missing or malformed")
        grads = mine.get("grads")
        if grads is not None:
            params = list(model.parameters())
            if len(grads) != len(params):
                raise CheckpointMismatchError(
                    f"{filename!r} holds {len(grads)} accumulated gradients, the model has {len(params)} "
                    "parameters"
                )
            for i, (g, p) in enumerate(zip(grads, params, strict=True)):
                local = p.to_local() if isinstance(p, DTensor) else p
                if g is not None and tuple(g.shape) != tuple(local.shape):
                    raise CheckpointMismatchError(
                        f"{filename!r}: accumulated gradient {i} has shape {tuple(g.shape)} there and "
                        f"{tuple(local.shape)} here"
                    )


def resume_checkpoint(
    run: RunState,
    filename: str,
    resume_optimizer: bool,
    resume_param_scheduler: bool,
    map_location: Any,
    callback: Any,
) -> dict[str, Any]:
    model, plugin = run.model, run.plugin
    assert model is not None
    # ---- phase 1: verify and read; nothing live is written ----
    meta = verify_dir(filename)["meta"]  # type: ignore[index]  # before any byte of DCP data is read
    resuming = (
        run.optim_wrapper if resume_optimizer else None
    )  # the optim wrapper whose optimizer this resume fills
    if meta.get("mid_window") and resuming is not None and meta.get("world_size") != run.world_size:
        raise CheckpointMismatchError(
            f"{filename!r} was saved inside an accumulation window at world size {meta.get('world_size')}; its "
            f"per-rank gradients cannot be mapped to world size {run.world_size}. Resume at world size "
            f"{meta.get('world_size')}, or from a checkpoint saved at a window boundary"
        )
    msd, osd = plugin.get_state_dict(model, resuming.optimizer if resuming is not None else [])
    tensors: dict[str, Any] = {"model": msd}
    try:
        if resuming is not None:
            metadata = read_dcp_metadata(filename)
            check_template(filename, tensors, metadata, ["model"])  # the model first: the clearer message
            optimizer = unwrap_optimizer(resuming.optimizer)
            fit_template(osd, filename, optimizer, root=("tensors", "optimizer"), metadata=metadata)
            tensors["optimizer"] = osd
        device = plugin.device if map_location == "default" else map_location
        fresh, shared, mine = read_dir(filename, tensors, map_location=device, exact=list(tensors))
    except CheckpointMismatchError as exc:
        if meta.get("plugin") == plugin.name:
            raise
        note = f" (saved with plugin {meta.get('plugin')!r}, this run uses {plugin.name!r})"
        raise CheckpointMismatchError(f"{exc}{note}") from exc
    _check_objects(run, filename, shared, mine, resume_param_scheduler)
    acc = (mine or {}).get("accumulation") or shared.get("accumulation")
    sched_states = shared.get("extra", {}).get("param_schedulers")
    if not (resume_param_scheduler and run.param_schedulers):
        sched_states = None
    scale = None
    if resuming is not None:
        scale = iteration_scale(meta, run.global_batch_size, resuming.accumulative_counts, filename)
        _note_global_batch(run, meta)
    if resuming is not None and scale is not None:  # the global batch kept at another count: the new unit
        if acc is not None:
            acc = scale.window(acc, resuming.window.state_dict())
        if sched_states is not None:
            assert run.param_schedulers is not None
            sched_states = scale.schedulers(run.param_schedulers, sched_states)
        meta = {**meta, "iter": scale("iter", int(meta.get("iter", 0)))}
        run.logger.info(
            f"resume: accumulative_counts {scale.old} -> {scale.new} keeps global_batch_size="
            f"{run.global_batch_size}; iteration counters converted (iter {meta['iter']})"
        )
    ckpt: dict[str, Any] = {"meta": meta, "state_dict": fresh["model"], **shared.get("extra", {})}
    if resuming is not None:
        ckpt["optimizer"] = fresh["optimizer"]
    if callback is not None:
        callback(ckpt)
    # ---- phase 2: apply ----
    if resuming is not None:
        plugin.set_state_dict(model, resuming.optimizer, ckpt["state_dict"], ckpt["optimizer"])
        if acc is not None:
            with warnings.catch_warnings():
                if mine is not None and mine.get("grads") is not None:  # restored below: the warning is moot
                    warnings.filterwarnings("ignore", message=".*middle of an accumulation window")
                resuming.window.load_state_dict(acc)
        if shared.get("base_param_settings") is not None:
            resuming.base_param_settings = shared["base_param_settings"]
        boosted = cast(BoostedOptimizer, resuming.optimizer)
        boosted.load_scaler_state_dict(shared.get("scaler"))
        # the checkpoint's gradients replace the live ones (a plugin's reduced pieces included): none at a
        # window boundary, this rank's saved ones inside a window
        boosted.zero_grad(set_to_none=True)
        grads = (mine or {}).get("grads")
        if grads is not None:
            for p, g in zip(model.parameters(), grads, strict=True):
                if g is None:
                    p.grad = None
                elif isinstance(p, DTensor):
                    p.grad = DTensor.from_local(
                        g.to(p.to_local().device),
                        p.device_mesh,
                        p.placements,
                        shape=p.shape,
                        stride=p.stride(),
                    )
                else:
                    p.grad = g.to(p.device)
            set_fsdp_pending_grads(model, (mine or {}).get("fsdp_pending_grads") or [])
    else:
        _set_weights(run, model, ckpt["state_dict"])
    if sched_states is not None:
        assert run.param_schedulers is not None
        for sched, state in zip(run.param_schedulers, sched_states, strict=True):
            sched.load_state_dict(state)
    for name, (obj, per_rank) in run.statefuls.items():
        source = (mine or {}).get("statefuls", {}) if per_rank else shared.get("statefuls", {})
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
