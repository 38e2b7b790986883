# SPDX-License-Identifier: Apache-2.0
"""``Strategy``: mmengine's ColossalAIStrategy API on the stepforge Booster, with crash-safe DCP directory
checkpoints (:mod:`stepforge.strategy.checkpoint`). Unlike mmengine's it honours ``compile``, ``callback``,
``map_location``, ``strict`` and ``revise_keys``, restores the accumulation counter, the loss scaler and every
rank's RNG state, and can be created many times per process."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from stepforge.core import OPTIM_WRAPPERS, Plugin

from ._env import (
    ENV_KWARGS,
    LOG_KWARGS,
    check_dict,
    close_logger,
    get_world_size,
    setup_env,
    setup_logger,
)
from .boosted_model import plugin_module
from .booster import Booster
from .checkpoint import (
    RunState,
    check_resume_option,
    checkpoint_to_resume,
    find_latest_checkpoint,
    load_checkpoint,
    resume_checkpoint,
    save_checkpoint,
)
from .compile import compile_config, compile_model
from .optim_wrappers import ColossalAIOptimWrapper
from .schedulers import build_param_scheduler

__all__ = ["Strategy", "ColossalAIStrategy"]


class Strategy:
    """Prepare, checkpoint and resume a training run through a :class:`~stepforge.strategy.Booster` (``plugin``,
    ``mixed_precision`` and ``memory_budget`` are the Booster's); the other arguments are the package README's
    section "Strategy: prepare, checkpoint, resume" and docs/checkpoints.md."""

    def __init__(
        self,
        *,
        plugin: Any = None,
        mixed_precision: Any = None,
        model_wrapper: Any = None,
        work_dir: str = "work_dirs",
        experiment_name: str | None = None,
        env_kwargs: Mapping[str, Any] | None = None,
        log_kwargs: Mapping[str, Any] | None = None,
        auto_scale_lr: Mapping[str, Any] | None = None,
        config: Any = None,
        resume: bool | str = False,
        memory_budget: Mapping[str, Any] | None = None,
        global_batch_size: int | None = None,
    ) -> None:
        check_resume_option(resume)
        gbs = global_batch_size
        if gbs is not None and (not isinstance(gbs, int) or isinstance(gbs, bool) or gbs <= 0):
            raise ValueError(
                "global_batch_size must be None or a positive int (samples per optimizer step over all ranks: world "
                f"size x train_micro_batch_size_per_gpu x accumulative_counts), got {gbs!r}"
            )
        self.global_batch_size = gbs
        env = check_dict("env_kwargs", env_kwargs, ENV_KWARGS)
        logs = check_dict("log_kwargs", log_kwargs, LOG_KWARGS)
        scale = check_dict("auto_scale_lr", auto_scale_lr, frozenset({"base_batch_size", "enable"}))
        base = scale.get("base_batch_size")
        if scale and scale.get("enable", True) and not (isinstance(base, int) and base > 0):
            raise ValueError(f"auto_scale_lr needs base_batch_size, a positive int; got {base!r}")
        self.auto_scale_lr = scale
        if model_wrapper is not None and not callable(model_wrapper):
            raise TypeError(
                f"model_wrapper must be None or a callable taking the boosted model, got {model_wrapper!r}"
            )
        self.env = setup_env(**env)
        self.work_dir = os.path.abspath(work_dir)
        os.makedirs(self.work_dir, exist_ok=True)
        self.timestamp = self.env.timestamp
        self.experiment_name = f"{experiment_name}_{self.timestamp}" if experiment_name else self.timestamp
        self.log_dir = os.path.join(self.work_dir, self.timestamp)
        self.logger, self.log_file = setup_logger(
            self.experiment_name, self.log_dir, self.timestamp, rank=self.env.rank, **logs
        )
        self.config = config
        self.model_wrapper = model_wrapper
        self.booster = Booster(mixed_precision=mixed_precision, plugin=plugin, memory_budget=memory_budget)
        self.dispatch_kwargs: dict[str, Any] = {}
        self.model: nn.Module | None = None
        self.optim_wrapper: ColossalAIOptimWrapper | None = None
        self.param_schedulers: list[Any] | None = None
        self.statefuls: dict[str, tuple[Any, bool]] = {}
        self.resume_option: bool | str = resume
        self.resumed_from: str | None = None  # the checkpoint prepare() resumed (None: the run started fresh)
        self._prepared = False

    # -- properties ----------------------------------------------------------------------------------------
    @property
    def seed(self) -> int:
        """The run's shared seed (drawn on rank 0 when none was given)."""
        return self.env.seed

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def plugin(self) -> Plugin:
        """The Booster's plugin (with ``plugin="auto"``, the chosen one once :meth:`prepare` ran)."""
        return self.booster.plugin

    @property
    def plugin_name(self) -> str:
        return self.plugin.name

    # -- prepare -------------------------------------------------------------------------------------------
    def prepare(
        self,
        model: nn.Module,
        *,
        optim_wrapper: Any = None,
        param_scheduler: Any = None,
        compile: bool | Mapping[str, Any] = False,
        dispatch_kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        """Boost ``model`` (rank 0's weights on every rank), build the optim wrapper and schedulers; returns
        what exists, as mmengine: ``model``, ``(model, optim_wrapper)`` or ``(model, optim_wrapper,
        schedulers)``."""
        if self._prepared:
            return self._components()
        self.dispatch_kwargs.update(check_dict("dispatch_kwargs", dispatch_kwargs))
        if not isinstance(model, nn.Module):
            raise TypeError(f"Strategy.prepare: model must be a torch.nn.Module, got {type(model).__name__}")
        compile_cfg = compile_config(compile, where="Strategy.prepare")
        broadcast_weights(model)
        wrapper = None
        micro_batch = self.dispatch_kwargs.get("train_micro_batch_size_per_gpu")
        if optim_wrapper is not None and self.global_batch_size is not None:
            optim_wrapper = keep_global_batch(
                optim_wrapper, self.global_batch_size, self.world_size, micro_batch
            )
        if optim_wrapper is None:
            model = self.booster.boost(model, compile=compile)[0]
        else:
            model, wrapper = build_optim_wrapper(self.booster, model, optim_wrapper, compile)
        if compile_cfg is not None:
            self.logger.info(
                f"torch.compile({dict(compile_cfg.options)}) applied to the model's {compile_cfg.target!r} (per "
                "FSDP2 block under torch_fsdp/gemini); the first iterations are slow while it compiles"
            )
        if self.booster.auto_choice is not None:  # into the run's own log (mmengine's, under FlexibleRunner)
            self.logger.info("%s\n%s", self.booster.auto_choice.reason, self.booster.auto_choice.table)
        # mmengine's strategies hand back the DDP/FSDP module, not a ModelWrapper
        model = plugin_module(model)
        if self.model_wrapper is not None:
            model = self.model_wrapper(model)
        self.model, self.optim_wrapper = model, wrapper
        if wrapper is not None:
            scale_lr(wrapper, self.auto_scale_lr, self.world_size, micro_batch, self.logger)
            start_accumulation(wrapper, model, self.dispatch_kwargs.get("max_iters"))
            if param_scheduler is not None:
                self.param_schedulers = build_param_scheduler(
                    param_scheduler,
                    wrapper,
                    epoch_length=self.dispatch_kwargs.get("epoch_length"),
                    max_epochs=self.dispatch_kwargs.get("max_epochs"),
                    max_iters=self.dispatch_kwargs.get("max_iters"),
                )
        elif param_scheduler is not None:
            raise ValueError("Strategy.prepare: param_scheduler needs an optim_wrapper to schedule")
        self._prepared = True
        path = checkpoint_to_resume(self.resume_option, self.work_dir, self.logger)
        if path is not None:
            self.resume(path)
            self.resumed_from = path
        return self._components()

    def _components(self) -> Any:
        if self.optim_wrapper is None:
            return self.model
        if self.param_schedulers is None:
            return self.model, self.optim_wrapper
        return self.model, self.optim_wrapper, self.param_schedulers

    @staticmethod
    def compile_model(model: nn.Module, compile: bool | Mapping[str, Any]) -> nn.Module:
        """mmengine's ``compile_model``: compile the model inside ``model`` in place and return ``model``
        (:mod:`stepforge.strategy.compile`)."""
        compile_model(model, compile, where="Strategy.compile_model")
        return model

    # -- checkpoints ---------------------------------------------------------------------------------------
    def register_for_checkpointing(self, name: str, obj: Any, *, per_rank: bool = False) -> None:
        """Save ``obj.state_dict()`` in every checkpoint and restore it on :meth:`resume`; ``per_rank=True`` keeps one
        copy per rank (same-size runs only). With ``resume="auto"``, register before :meth:`prepare`."""
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise TypeError(f"register_for_checkpointing({name!r}): obj needs state_dict and load_state_dict")
        self.statefuls[name] = (obj, per_rank)

    def save_checkpoint(
        self,
        filename: str,
        *,
        save_optimizer: bool = True,
        save_param_scheduler: bool = True,
        extra_ckpt: Mapping[str, Any] | None = None,
        callback: Any = None,
        max_keep_ckpts: int | None = None,
    ) -> str:
        """Write a committed checkpoint directory under ``work_dir`` (collective); returns its path.
        ``max_keep_ckpts`` deletes the oldest committed ones of that folder after the commit."""
        if not self._prepared:
            raise RuntimeError("Strategy.save_checkpoint: call prepare() first (there is nothing to save)")
        return save_checkpoint(
            self._run_state(),
            filename,
            save_optimizer,
            save_param_scheduler,
            extra_ckpt,
            callback,
            max_keep_ckpts,
        )

    def load_checkpoint(
        self,
        filename: str,
        *,
        map_location: Any = "cpu",
        strict: bool = False,
        revise_keys: Sequence[tuple[str, str]] = ((r"^module\.", ""),),
        callback: Any = None,
    ) -> dict[str, Any]:
        """Load the model weights only; returns the checkpoint dict (``meta``, ``state_dict``, extras)."""
        return load_checkpoint(self._run_state(), filename, map_location, strict, revise_keys, callback)

    def resume(
        self,
        filename: str,
        *,
        resume_optimizer: bool = True,
        resume_param_scheduler: bool = True,
        map_location: Any = "default",
        callback: Any = None,
    ) -> dict[str, Any]:
        """Restore model, optimizer, schedulers, registered statefuls and every rank's RNG state; sets
        ``dispatch_kwargs['cur_iter']``. Returns the checkpoint dict."""
        if not self._prepared:
            raise RuntimeError("Strategy.resume: call prepare() first (resume fills the prepared objects)")
        return resume_checkpoint(
            self._run_state(), filename, resume_optimizer, resume_param_scheduler, map_location, callback
        )

    def _run_state(self) -> RunState:
        mixed = self.booster.mixed_precision
        return RunState(
            model=self.model,
            optim_wrapper=self.optim_wrapper,
            plugin=self.plugin,
            mixed_precision=mixed.name if mixed is not None else None,
            param_schedulers=self.param_schedulers,
            statefuls=self.statefuls,
            dispatch_kwargs=self.dispatch_kwargs,
            seed=self.seed,
            global_batch_size=self.global_batch_size,
            experiment_name=self.experiment_name,
            world_size=self.world_size,
            rank=self.rank,
            work_dir=self.work_dir,
            deterministic=self.env.deterministic,
            config=self.config,
            logger=self.logger,
        )

    def find_latest_checkpoint(self) -> str | None:
        """The last committed checkpoint of ``work_dir`` (``last_checkpoint``), or None."""
        return find_latest_checkpoint(self.work_dir)

    def load_or_resume(
        self, *, load_from: str | None = None, resume: bool | str = False
    ) -> dict[str, Any] | None:
        """mmengine's rule: ``resume=<path>``; ``resume=True`` (or ``"auto"``) → ``load_from`` or the latest;
        else load."""
        if isinstance(resume, str) and resume != "auto":
            return self.resume(resume)
        if resume:
            path = load_from or self.find_latest_checkpoint()
            if path is None:
                self.logger.info("resume=True but no checkpoint in work_dir: training from scratch")
                return None
            return self.resume(path)
        return self.load_checkpoint(load_from) if load_from else None

    def close(self) -> None:
        """Release the log file."""
        close_logger(self.logger)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(plugin={self.plugin_name!r}, world_size={self.world_size}, "
            f"work_dir={self.work_dir!r}, experiment_name={self.experiment_name!r})"
        )


class ColossalAIStrategy(Strategy):
    """mmengine's ``ColossalAIStrategy``: :class:`Strategy` with ``plugin="gemini"`` by default."""

    def __init__(self, *, plugin: Any = "gemini", **kwargs: Any) -> None:
        super().__init__(plugin=plugin, **kwargs)


# -- the steps of Strategy.prepare ---------------------------------------------------------------------------
def broadcast_weights(model: nn.Module) -> None:
    """Copy rank 0's parameters and buffers into ``model`` on every rank (meta tensors skipped); NCCL moves
    CUDA tensors only, so CPU tensors travel through the current device."""
    if get_world_size() == 1:
        return
    staging = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            if tensor.is_meta:
                continue  # lazy: every rank materialises the same values at boost
            if staging is None or tensor.device == staging:
                dist.broadcast(tensor.data, src=0)
            else:
                staged = tensor.data.to(staging)
                dist.broadcast(staged, src=0)
                tensor.data.copy_(staged)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def accumulation_for_global_batch(global_batch: int, world_size: int, micro_batch: Any) -> int:
    """``accumulative_counts`` with ``world_size`` x ``micro_batch`` x counts == ``global_batch`` (DeepSpeed's
    rule), else a ``ValueError`` listing the micro-batch sizes and world sizes that would work."""
    if not isinstance(micro_batch, int) or isinstance(micro_batch, bool) or micro_batch <= 0:
        raise ValueError(
            f"global_batch_size={global_batch} needs dispatch_kwargs['train_micro_batch_size_per_gpu'] (samples "
            f"per rank per micro-batch; FlexibleRunner passes the train dataloader's batch_size), got {micro_batch!r}"
        )
    per_iteration = world_size * micro_batch
    if global_batch % per_iteration == 0:
        return global_batch // per_iteration
    micro = _divisors(global_batch // world_size) if global_batch % world_size == 0 else []
    worlds = _divisors(global_batch // micro_batch) if global_batch % micro_batch == 0 else []
    raise ValueError(
        f"global_batch_size={global_batch} is not a multiple of world size {world_size} x micro-batch "
        f"{micro_batch} (train_micro_batch_size_per_gpu) = {per_iteration}, so no accumulative_counts keeps it. "
        f"At world size {world_size}, micro-batch sizes {micro} work; with micro-batch {micro_batch}, world sizes "
        f"{worlds}; or set global_batch_size to a multiple of {per_iteration}"
    )


def keep_global_batch(cfg: Any, global_batch: int, world_size: int, micro_batch: Any) -> Any:
    """``cfg`` with the ``accumulative_counts`` keeping ``global_batch``; one given must be that one."""
    counts = accumulation_for_global_batch(global_batch, world_size, micro_batch)
    given = cfg.accumulative_counts if isinstance(cfg, ColossalAIOptimWrapper) else None
    if isinstance(cfg, Mapping):
        given = cfg.get("accumulative_counts")
        cfg = {**cfg, "accumulative_counts": counts}
    if given is not None and given != counts:
        raise ValueError(
            f"optim_wrapper accumulative_counts={given!r} contradicts global_batch_size={global_batch} = world size "
            f"{world_size} x micro-batch {micro_batch} x {counts}: leave accumulative_counts out (global_batch_size "
            "derives it at every world size) or drop global_batch_size"
        )
    return cfg


def _window(counts: Any) -> int | None:
    # None where it is not a positive int: the wrapper's own check names it
    return counts if isinstance(counts, int) and not isinstance(counts, bool) and counts >= 1 else None


def build_optim_wrapper(
    booster: Booster, model: nn.Module, cfg: Any, compile: Any = False
) -> tuple[nn.Module, Any]:
    """Boost ``model`` with the optimizer of ``cfg`` (a dict or a built ``ColossalAIOptimWrapper``); returns
    the model and the optim wrapper (its ``accumulative_counts`` is ``boost``'s ``accumulation_steps``)."""
    if isinstance(cfg, ColossalAIOptimWrapper):
        steps = _window(cfg.accumulative_counts)
        model, cfg.optimizer = booster.boost(model, cfg.optimizer, compile=compile, accumulation_steps=steps)[
            :2
        ]
        cfg.booster = booster
        return model, cfg
    if not isinstance(cfg, Mapping):
        raise TypeError(
            "Strategy.prepare: optim_wrapper must be a dict (dict(optimizer=dict(type='AdamW', lr=1e-3), "
            f"accumulative_counts=1)) or a ColossalAIOptimWrapper, got {type(cfg).__name__}"
        )
    cfg = dict(cfg)
    name = cfg.pop("type", "ColossalAIOptimWrapper")
    cls = OPTIM_WRAPPERS.get(name) if isinstance(name, str) else name
    if not (isinstance(cls, type) and issubclass(cls, ColossalAIOptimWrapper)):
        raise ValueError(
            f"Strategy.prepare: optim_wrapper type must be ColossalAIOptimWrapper or a subclass (it drives the "
            f"Booster), got {name!r}"
        )
    for key in ("constructor", "paramwise_cfg"):
        if key in cfg:
            raise ValueError(
                f"Strategy.prepare: optim_wrapper {key!r} is not supported; build the optimizer with param "
                "groups yourself and pass it as optim_wrapper=dict(optimizer=<optimizer>)"
            )
    if "optimizer" not in cfg:
        raise ValueError(
            "Strategy.prepare: optim_wrapper needs 'optimizer' (a dict such as dict(type='AdamW'))"
        )
    optimizer = cfg.pop("optimizer")
    optimizer = dict(optimizer) if isinstance(optimizer, Mapping) else optimizer
    steps = _window(cfg.get("accumulative_counts", 1))
    model, optimizer = booster.boost(model, optimizer, compile=compile, accumulation_steps=steps)[:2]
    return model, cls(optimizer, booster=booster, **cfg)


def scale_lr(
    wrapper: Any,
    auto_scale_lr: Mapping[str, Any],
    world_size: int,
    micro_batch: Any,
    logger: logging.Logger,
) -> None:
    """lr *= ``world_size`` * ``micro_batch`` * accumulative_counts / base_batch_size, in place."""
    if not auto_scale_lr or not auto_scale_lr.get("enable", True):
        return
    if not isinstance(micro_batch, int) or micro_batch <= 0:
        raise ValueError(
            "auto_scale_lr needs dispatch_kwargs['train_micro_batch_size_per_gpu'] (samples per rank per "
            f"micro-batch), got {micro_batch!r}"
        )
    base = auto_scale_lr["base_batch_size"]
    ratio = world_size * micro_batch * wrapper.accumulative_counts / base
    for group in wrapper.param_groups:
        group["lr"] = group["lr"] * ratio
    if wrapper.base_param_settings is not None and "lr" in wrapper.base_param_settings:
        wrapper.base_param_settings["lr"] *= ratio
    logger.info(
        f"auto_scale_lr: lr scaled by {ratio:g} = world {world_size} x micro-batch {micro_batch} x "
        f"accumulative_counts {wrapper.accumulative_counts} / base {base}"
    )


def start_accumulation(wrapper: Any, model: nn.Module, max_iters: Any) -> None:
    """Start ``wrapper``'s accumulation window at iteration 0 when it accumulates; ``max_iters`` lets the last
    partial window step too."""
    counts = wrapper.accumulative_counts
    if counts <= 1:
        return
    if not isinstance(max_iters, int) or max_iters <= 0:
        raise ValueError(
            f"accumulative_counts={counts} needs dispatch_kwargs['max_iters'] (the number of training "
            "iterations, so the last partial window steps too); pass prepare(..., "
            "dispatch_kwargs=dict(max_iters=N))"
        )
    wrapper.initialize_count_status(model, 0, max_iters)
