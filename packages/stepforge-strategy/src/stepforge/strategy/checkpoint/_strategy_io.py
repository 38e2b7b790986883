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
import os
import time
from collections.abc import Mapping
from typing import Any, cast

import torch
from torch.distributed.tensor import DTensor

from stepforge.accum import OptimWrapper
from stepforge.core import BoostedOptimizer

from .._version import __version__
from ._dcp import save_dir
from ._fsdp_window import fsdp_pending_grads
from ._optim_template import saved_optimizer_state
from ._rng import get_rng_state
from ._run_state import RunState

__all__ = ["save_checkpoint"]

_OPTIM_ROOT = ("tensors", "optimizer")  # where save_dir puts the optimizer's state dict in the DCP tree


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


def _boosted(wrapper: OptimWrapper) -> BoostedOptimizer:
    # RunState's contract: the wrapper's optimizer is the one the Booster boosted (Strategy.prepare did it)
    return cast(BoostedOptimizer, wrapper.optimizer)


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
    if mid_window:
        assert wrapper is not None and window is not None
        refusal = plugin.mid_window_save_refusal(wrapper.optimizer)
        if refusal is not None:
            raise ValueError(
                f"save_checkpoint: {window.position} micro-batch(es) of an accumulation window are not stepped "
                f"yet and plugin {plugin.name!r} cannot save them: {refusal}; save at a window boundary (every "
                f"accumulative_counts={window.counts} iterations)"
            )
    with_optim = save_optimizer and wrapper is not None
    msd, osd = plugin.get_state_dict(model, wrapper.optimizer if wrapper is not None and with_optim else [])
    if with_optim:
        assert wrapper is not None
        osd = saved_optimizer_state(wrapper.optimizer, osd)
    extra = dict(extra_ckpt or {})
    iteration = window.inner_count if window is not None else run.dispatch_kwargs.get("cur_iter", 0)
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
        "accumulative_counts": wrapper.accumulative_counts if wrapper is not None else 1,
        "global_batch_size": _global_batch(run, wrapper.accumulative_counts if wrapper is not None else 1),
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
