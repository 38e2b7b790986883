# SPDX-License-Identifier: Apache-2.0
"""Strategy loads, verify then apply: ``load`` (model weights) and ``resume`` (the whole run).

Phase 1 touches nothing live: the commit marker and every file's CRC-32, the plugin and world size recorded in
the meta, the model's keys, shapes and dtypes, the optimizer's groups, parameters and state layout
(:func:`~stepforge.strategy.checkpoint._optim_template.fit_template`), then every object blob and every tensor is read
into fresh tensors, and the scheduler list, accumulation state, saved gradients and RNG states are checked
against the live run. Only then, phase 2 applies them: weights and optimizer (``Plugin.set_state_dict``, its
lr included), accumulation window, scaler, gradients, schedulers, statefuls, RNG, iteration. Any failure of
phase 1 raises :class:`CheckpointError` naming the file and the difference, with the run exactly as it was.

Gradients after a successful resume are as the checkpoint says: saved inside an accumulation window, this
rank's window gradients come back; saved at a window boundary, every ``.grad`` is ``None`` (as the
uninterrupted run has them after its step).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
from torch.distributed.tensor import DTensor

from stepforge.core import BoostedOptimizer, unwrap_optimizer

from .._env import set_random_seed
from ._dcp import check_template, read_dcp_metadata, read_dir, verify_files
from ._fsdp_window import set_fsdp_pending_grads
from ._layout import CheckpointError, CheckpointMismatchError
from ._optim_template import fit_template
from ._rescale import iteration_scale
from ._rng import set_rng_state
from ._run_state import RunState

__all__ = ["load_checkpoint", "resume_checkpoint"]


def _revise(keys: Sequence[str], revise_keys: Sequence[tuple[str, str]]) -> dict[str, str]:
    out = {}
    for key in keys:
        new = key
        for pattern, repl in revise_keys:
            new = re.sub(pattern, repl, new)
        out[new] = key
    return out


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
    verify_files(
        filename
    )  # a clear error for an unfinished or damaged checkpoint before reading its metadata
    stored = read_dcp_metadata(filename).state_dict_metadata
    prefix = "tensors.model."
    saved_keys = [k[len(prefix) :] for k in stored if k.startswith(prefix)]
    revised = _revise(saved_keys, revise_keys)
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
    fresh, shared, _, meta = read_dir(
        filename, {"model": template}, map_location=map_location, rank_objects=False, files_checked=True
    )
    assert shared is not None, "read_dir returns the objects when asked for them (the default)"
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


def _map_location(run: RunState, map_location: Any) -> Any:
    return run.plugin.device if map_location == "default" else map_location


def _check_meta(run: RunState, filename: str, meta: Mapping[str, Any], with_optim: bool) -> None:
    same_world = meta.get("world_size") == run.world_size
    if meta.get("mid_window") and with_optim and not same_world:
        raise CheckpointMismatchError(
            f"{filename!r} was saved inside an accumulation window at world size {meta.get('world_size')}; its "
            f"per-rank gradients cannot be mapped to world size {run.world_size}. Resume at world size "
            f"{meta.get('world_size')}, or from a checkpoint saved at a window boundary"
        )


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


def _plugin_note(run: RunState, meta: Mapping[str, Any]) -> str:
    saved = meta.get("plugin")
    return (
        ""
        if saved == run.plugin.name
        else f" (saved with plugin {saved!r}, this run uses {run.plugin.name!r})"
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


def _set_grads(model: torch.nn.Module, grads: Sequence[torch.Tensor | None]) -> None:
    for p, g in zip(model.parameters(), grads, strict=True):
        if g is None:
            p.grad = None
        elif isinstance(p, DTensor):
            p.grad = DTensor.from_local(
                g.to(p.to_local().device), p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
            )
        else:
            p.grad = g.to(p.device)


def resume_checkpoint(
    run: RunState,
    filename: str,
    resume_optimizer: bool,
    resume_param_scheduler: bool,
    map_location: Any,
    callback: Any,
) -> dict[str, Any]:
    model, wrapper, plugin = run.model, run.optim_wrapper, run.plugin
    assert model is not None
    # ---- phase 1: verify and read; nothing live is written ----
    meta = verify_files(filename)["meta"]  # before any byte of DCP data is read
    with_optim = resume_optimizer and wrapper is not None
    _check_meta(run, filename, meta, with_optim)
    msd, osd = plugin.get_state_dict(model, wrapper.optimizer if wrapper is not None and with_optim else [])
    tensors: dict[str, Any] = {"model": msd}
    exact = ["model"]
    metadata = read_dcp_metadata(filename)
    if with_optim:
        assert wrapper is not None
        try:
            check_template(filename, tensors, metadata, exact)  # the model first: the clearer message
            fit_template(
                osd,
                filename,
                unwrap_optimizer(wrapper.optimizer),
                root=("tensors", "optimizer"),
                metadata=metadata,
            )
        except CheckpointMismatchError as exc:
            raise CheckpointMismatchError(f"{exc}{_plugin_note(run, meta)}") from exc
        tensors["optimizer"] = osd
        exact.append("optimizer")
    try:
        fresh, shared, mine, meta = read_dir(
            filename,
            tensors,
            map_location=_map_location(run, map_location),
            exact=exact,
            files_checked=True,
        )
    except CheckpointMismatchError as exc:
        raise CheckpointMismatchError(f"{exc}{_plugin_note(run, meta)}") from exc
    assert shared is not None, "read_dir returns the objects when asked for them (the default)"
    _check_objects(run, filename, shared, mine, resume_param_scheduler)
    acc = (mine or {}).get("accumulation") or shared.get("accumulation")
    sched_states = shared.get("extra", {}).get("param_schedulers")
    if not (resume_param_scheduler and run.param_schedulers):
        sched_states = None
    scale = None
    if with_optim:
        assert wrapper is not None
        scale = iteration_scale(meta, run.global_batch_size, wrapper.accumulative_counts, filename)
        _note_global_batch(run, meta)
    if scale is not None:  # the global batch is kept at another accumulation count: counters in the new unit
        assert wrapper is not None
        if acc is not None:
            acc = scale.window(acc, wrapper.window.state_dict())
        if sched_states is not None:
            assert run.param_schedulers is not None
            sched_states = scale.schedulers(run.param_schedulers, sched_states)
        meta = {**meta, "iter": scale("iter", int(meta.get("iter", 0)))}
        run.logger.info(
            f"resume: accumulative_counts {scale.old} -> {scale.new} keeps global_batch_size="
            f"{run.global_batch_size}; iteration counters converted (iter {meta['iter']})"
        )
    ckpt: dict[str, Any] = {"meta": meta, "state_dict": fresh["model"], **shared.get("extra", {})}
    if with_optim:
        ckpt["optimizer"] = fresh["optimizer"]
    if callback is not None:
        callback(ckpt)
    # ---- phase 2: apply ----
    if with_optim:
        assert wrapper is not None
        plugin.set_state_dict(model, wrapper.optimizer, ckpt["state_dict"], ckpt["optimizer"])
        if acc is not None:
            with warnings.catch_warnings():
                if mine is not None and mine.get("grads") is not None:  # restored below: the warning is moot
                    warnings.filterwarnings("ignore", message=".*middle of an accumulation window")
                wrapper.window.load_state_dict(acc)
        if shared.get("base_param_settings") is not None:
            wrapper.base_param_settings = shared["base_param_settings"]
        boosted = cast(BoostedOptimizer, wrapper.optimizer)
        boosted.load_scaler_state_dict(shared.get("scaler"))
        # the checkpoint's gradients replace the live ones (a plugin's reduced pieces included): none at a
        # window boundary, this rank's saved ones inside a window
        boosted.zero_grad(set_to_none=True)
        grads = (mine or {}).get("grads")
        if grads is not None:
            _set_grads(model, grads)
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
