# SPDX-License-Identifier: Apache-2.0
"""``StepforgeStrategy``: a :class:`stepforge.strategy.Strategy` as mmengine's ``FlexibleRunner`` expects one.

``FlexibleRunner`` builds its strategy from ``STRATEGIES`` with ``work_dir``, ``experiment_name``,
``auto_scale_lr``, ``env_kwargs`` (``launcher``, ``randomness``, ``env_cfg``) and ``log_kwargs``, then uses
``prepare``, ``model``/``optim_wrapper``/``param_schedulers``, ``save_checkpoint``/``load_checkpoint``/``resume``,
``logger`` (an ``MMLogger``), ``log_dir``, ``timestamp``, ``seed``, ``rank``, ``world_size``, ``distributed``,
``collect_env`` and ``experiment_name``. This class provides exactly that on top of a stepforge ``Strategy``
(which it holds as :attr:`StepforgeStrategy.strategy`): process group on gloo without CUDA (no
``torch.cuda.set_device``), crash-safe DCP checkpoint directories, the accumulation counter, loss scaler and
every rank's RNG restored on resume, and the message hub saved as plain data (:mod:`._message_hub`) so the
checkpoint loads under ``torch.load(weights_only=True)``.

Use the dict form in a config, ``strategy=dict(type="StepforgeStrategy", plugin="zero2")``: FlexibleRunner
accepts a built strategy only if it subclasses mmengine's private ``BaseStrategy``.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from mmengine.logging import MMLogger
from mmengine.model import BaseModel, BaseModule
from mmengine.registry import MODELS
from mmengine.utils.dl_utils import collect_env as mm_collect_env
from torch import nn

from stepforge.strategy import Strategy

from ._message_hub import message_hub_from_plain, message_hub_to_plain
from .model_wrapper import StepforgeModelWrapper

__all__ = ["StepforgeStrategy", "StepforgeColossalAIStrategy"]

_PREFIX = "Stepforge"


def _strip_prefix(cfg: Any) -> Any:
    """``StepforgeCPUAdam`` / ``StepforgeColossalAIOptimWrapper`` (mmengine registry names) → stepforge names."""
    if not isinstance(cfg, Mapping):
        return cfg
    out = dict(cfg)
    kind = out.get("type")
    if isinstance(kind, str) and kind.startswith(_PREFIX) and len(kind) > len(_PREFIX):
        out["type"] = kind[len(_PREFIX) :]
    return out


def _env_for_stepforge(env_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    env = dict(env_kwargs or {})
    dist_cfg = dict(env.get("dist_cfg") or {})
    # FlexibleRunner's default env_cfg names nccl; a CPU machine has none, and gloo is what works there
    if dist_cfg.get("backend") == "nccl" and not torch.cuda.is_available():
        dist_cfg["backend"] = "gloo"
    if dist_cfg:
        env["dist_cfg"] = dist_cfg
    if env.get("randomness") is None:
        env.pop("randomness", None)
    return env


class StepforgeStrategy:
    """FlexibleRunner strategy on :class:`stepforge.strategy.Strategy` (registered as ``StepforgeStrategy``).

    Args:
        plugin: a stepforge plugin name, dict or instance (``"zero2"``, ``"torch_ddp"``, ``"torch_fsdp"``,
            ``"gemini"``...); ``None`` picks ``single`` on one process and ``torch_ddp`` on several.
        mixed_precision: ``"fp16"``, ``"bf16"``, ``"fp8"`` or ``None``.
        work_dir: the run's directory (filled in by ``FlexibleRunner``).
        experiment_name: the run's name (filled in by ``FlexibleRunner``).
        env_kwargs: mmengine's environment settings (``env_kwargs["dist_cfg"]["backend"] == "nccl"`` becomes
            ``gloo`` when CUDA is unavailable).
        log_kwargs: mmengine's logger settings.
        auto_scale_lr: mmengine's ``auto_scale_lr`` (``base_batch_size``, ``enable``).
        config: recorded as ``meta["cfg"]`` when the runner does not record its own.
        memory_budget: stepforge's ``memory_budget`` (``dict(device="70GiB", host="200GiB")``); with
            ``plugin="auto"`` the fastest plugin that fits is chosen when the runner prepares the model.
        global_batch_size: samples per optimizer step over all ranks, kept at every world size: the optim
            wrapper's ``accumulative_counts`` is derived from it and the train loader's ``batch_size`` (see
            :class:`stepforge.strategy.Strategy`); leave ``accumulative_counts`` out of the optim wrapper config.

    The optim wrapper config is stepforge's: ``dict(type="ColossalAIOptimWrapper", optimizer=dict(type="CPUAdam",
    lr=1e-3), accumulative_counts=4)``; the ``Stepforge`` prefix of mmengine's registry names is accepted too.
    """

    def __init__(
        self,
        *,
        plugin: Any = None,
        mixed_precision: Any = None,
        work_dir: str = "work_dirs",
        experiment_name: str | None = None,
        env_kwargs: Mapping[str, Any] | None = None,
        log_kwargs: Mapping[str, Any] | None = None,
        auto_scale_lr: Mapping[str, Any] | None = None,
        config: Any = None,
        memory_budget: Mapping[str, Any] | None = None,
        global_batch_size: int | None = None,
    ) -> None:
        logs = dict(log_kwargs or {})
        self._env_kwargs = _env_for_stepforge(env_kwargs)
        self.strategy = Strategy(
            plugin=plugin,
            mixed_precision=mixed_precision,
            work_dir=work_dir,
            experiment_name=experiment_name,
            env_kwargs=self._env_kwargs,
            log_kwargs={k: v for k, v in logs.items() if v is not None},
            auto_scale_lr=auto_scale_lr,
            config=config,
            memory_budget=memory_budget,
            global_batch_size=global_batch_size,
        )
        # one log file, written by mmengine's logger (the runner's hooks log through MMLogger)
        self.strategy.close()
        self.logger: MMLogger = MMLogger.get_instance(
            self.experiment_name,
            logger_name="mmengine",
            log_file=os.path.join(self.log_dir, f"{self.timestamp}.log"),
            log_level=logs.get("log_level") or "INFO",
            file_mode=logs.get("file_mode", "a"),
            distributed=bool(logs.get("all_ranks", False)),
        )
        self.strategy.logger = self.logger
        self.model: Any = None
        self.optim_wrapper: Any = None
        self.param_schedulers: Any = None

    # -- what FlexibleRunner reads ---------------------------------------------------------------------
    @property
    def work_dir(self) -> str:
        return self.strategy.work_dir

    @property
    def log_dir(self) -> str:
        return self.strategy.log_dir

    @property
    def experiment_name(self) -> str:
        return self.strategy.experiment_name

    @property
    def timestamp(self) -> str:
        return self.strategy.timestamp

    @property
    def seed(self) -> int:
        return self.strategy.seed

    @property
    def rank(self) -> int:
        return self.strategy.rank

    @property
    def world_size(self) -> int:
        return self.strategy.world_size

    @property
    def distributed(self) -> bool:
        """True when more than one process trains (mmengine's meaning)."""
        return self.world_size > 1

    @property
    def launcher(self) -> str:
        return self.strategy.env.launcher

    @property
    def randomness(self) -> dict[str, Any]:
        env = self.strategy.env
        return dict(seed=env.seed, deterministic=env.deterministic, diff_rank_seed=env.diff_rank_seed)

    @property
    def dispatch_kwargs(self) -> dict[str, Any]:
        return self.strategy.dispatch_kwargs

    def collect_env(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(system environment as mmengine collects it, runtime environment incl. the stepforge plugin)."""
        runtime: OrderedDict[str, Any] = OrderedDict()
        runtime.update(self._env_kwargs)
        runtime.update(self.randomness)
        runtime["Distributed launcher"] = self.launcher
        runtime["Distributed training"] = self.distributed
        runtime["GPU number"] = self.world_size
        runtime["stepforge plugin"] = self.strategy.plugin_name
        return mm_collect_env(), runtime

    # -- prepare -------------------------------------------------------------------------------------------
    def prepare(
        self,
        model: nn.Module | dict[str, Any],
        *,
        optim_wrapper: Any = None,
        param_scheduler: Any = None,
        compile: bool | Mapping[str, Any] = False,
        dispatch_kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        """Build (from ``MODELS`` if a dict), initialise, boost and wrap the model; build the optim wrapper and
        schedulers. Idempotent, as mmengine's: a second call (``val``/``test``) returns the same objects."""
        if self.model is not None:
            return self._components()
        dispatch = dict(dispatch_kwargs or {})
        if isinstance(model, Mapping):
            model = MODELS.build(model)
        if not isinstance(model, BaseModel):
            raise TypeError(
                "StepforgeStrategy.prepare: the model must be an mmengine BaseModel or a MODELS config building one "
                f"(train_step needs its data_preprocessor and parse_losses), got {type(model).__name__}"
            )
        init_weights = dispatch.pop("init_weights_for_test_or_val", True)
        if isinstance(model, BaseModule) and init_weights:
            model.init_weights()
        module = model
        device = self.strategy.plugin.device
        if device.type != "cpu":
            module.to(device)  # BaseModel.to also moves its data preprocessor
        if isinstance(optim_wrapper, Mapping):
            optim_wrapper = _strip_prefix(optim_wrapper)
            if "optimizer" in optim_wrapper:
                optim_wrapper["optimizer"] = _strip_prefix(optim_wrapper["optimizer"])
        compile_cfg: Any = compile
        if isinstance(compile, Mapping) and compile.get("target") == "train_step":
            compile_cfg = {
                **compile,
                "target": "forward",
            }  # train_step lives on the wrapper, forward on the module
        prepared = self.strategy.prepare(
            module,
            optim_wrapper=optim_wrapper,
            param_scheduler=param_scheduler,
            compile=compile_cfg,
            dispatch_kwargs=dispatch,
        )
        boosted = prepared[0] if isinstance(prepared, tuple) else prepared
        self.model = StepforgeModelWrapper(boosted, module)
        self.optim_wrapper = self.strategy.optim_wrapper
        self.param_schedulers = self.strategy.param_schedulers
        return self._components()

    def _components(self) -> Any:
        if self.optim_wrapper is None:
            return self.model
        if self.param_schedulers is None:
            return self.model, self.optim_wrapper
        return self.model, self.optim_wrapper, self.param_schedulers

    # -- checkpoints -------------------------------------------------------------------------------------
    def save_checkpoint(
        self,
        filename: str,
        *,
        save_optimizer: bool = True,
        save_param_scheduler: bool = True,
        extra_ckpt: Mapping[str, Any] | None = None,
        callback: Callable[[dict[str, Any]], None] | None = None,
    ) -> str:
        """Write a committed checkpoint directory at ``filename`` (collective: every rank calls it).

        The runner's ``message_hub`` entry is stored as plain data (see :mod:`._message_hub`), rank 0's on
        every rank (so a resumed rank 1 continues rank 0's log history, as with mmengine's own strategies).
        """
        extra = dict(extra_ckpt or {})
        if "message_hub" in extra:
            hub = [message_hub_to_plain(extra["message_hub"])]
            if self.distributed:
                # every rank logs its own scalars; the checkpoint keeps rank 0's, as mmengine's rank-0 file does
                # (the strategy stores shared objects once, from whichever rank)
                dist.broadcast_object_list(hub, src=0)
            extra["message_hub"] = hub[0]
        return self.strategy.save_checkpoint(
            filename,
            save_optimizer=save_optimizer,
            save_param_scheduler=save_param_scheduler,
            extra_ckpt=extra,
            callback=callback,
        )

    @staticmethod
    def _restoring(callback: Callable[[dict[str, Any]], None] | None) -> Callable[[dict[str, Any]], None]:
        def restore(checkpoint: dict[str, Any]) -> None:
            if "message_hub" in checkpoint:
                checkpoint["message_hub"] = message_hub_from_plain(checkpoint["message_hub"])
            if callback is not None:
                callback(checkpoint)

        return restore

    def load_checkpoint(
        self,
        filename: str,
        *,
        map_location: Any = "cpu",
        strict: bool = False,
        revise_keys: Sequence[tuple[str, str]] = ((r"^module\.", ""),),
        callback: Callable[[dict[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        """Load the model weights from a stepforge checkpoint; returns the checkpoint dict."""
        return self.strategy.load_checkpoint(
            filename,
            map_location=map_location,
            strict=strict,
            revise_keys=revise_keys,
            callback=self._restoring(callback),
        )

    def resume(
        self,
        filename: str,
        *,
        resume_optimizer: bool = True,
        resume_param_scheduler: bool = True,
        map_location: Any = "default",
        callback: Callable[[dict[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        """Restore model, optimizer, schedulers, accumulation counter, loss scaler and RNG; returns the dict.

        When this run's ``max_iters`` differs from the saved run's, the accumulation total follows this run (so
        the last partial window is where this run ends), as mmengine's own strategies do.
        """
        checkpoint = self.strategy.resume(
            filename,
            resume_optimizer=resume_optimizer,
            resume_param_scheduler=resume_param_scheduler,
            map_location=map_location,
            callback=self._restoring(callback),
        )
        wrapper = self.optim_wrapper
        max_iters = self.dispatch_kwargs.get("max_iters")
        if (
            wrapper is not None
            and isinstance(max_iters, int)
            and wrapper.accumulative_counts > 1
            and wrapper.max_counts != max_iters
        ):
            if wrapper.inner_count % wrapper.accumulative_counts == 0:
                wrapper.initialize_count_status(self.model.module, wrapper.inner_count, max_iters)
            else:
                self.logger.warning(
                    f"resume: the checkpoint was saved mid-window for a run of {wrapper.max_counts} iterations; "
                    f"this run has max_iters={max_iters}, and its last partial window follows the saved run"
                )
        return checkpoint

    def load_or_resume(
        self, *, load_from: str | None = None, resume: bool | str = False
    ) -> dict[str, Any] | None:
        """mmengine's rule: ``resume=<path>``; ``resume=True`` → ``load_from`` or the latest; else load."""
        if isinstance(resume, str):
            return self.resume(resume)
        if resume:
            path = load_from or self.strategy.find_latest_checkpoint()
            return None if path is None else self.resume(path)
        return self.load_checkpoint(load_from) if load_from else None

    def __repr__(self) -> str:
        return f"StepforgeStrategy({self.strategy!r})"


class StepforgeColossalAIStrategy(StepforgeStrategy):
    """mmengine's ``ColossalAIStrategy`` name on :class:`StepforgeStrategy`: ``plugin="gemini"`` by default.

    Registered as ``StepforgeColossalAIStrategy``; importing ``stepforge.mmengine.override`` also registers it
    as ``ColossalAIStrategy``.
    """

    def __init__(self, *, plugin: Any = "gemini", **kwargs: Any) -> None:
        super().__init__(plugin=plugin, **kwargs)
