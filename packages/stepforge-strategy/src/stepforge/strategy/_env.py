# SPDX-License-Identifier: Apache-2.0
"""The process environment of a Strategy, with mmengine's ``BaseStrategy._setup_env`` semantics; an already
initialised default group is reused (several strategies can live in one process)."""

from __future__ import annotations

import atexit
import datetime
import functools
import itertools
import logging
import os
import random
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .accelerator import get_accelerator

__all__ = [
    "EnvInfo",
    "LOG_KWARGS",
    "close_logger",
    "setup_logger",
    "broadcast_object",
    "check_dict",
    "is_distributed",
    "destroy_group_at_exit",
    "get_rank",
    "get_world_size",
    "set_random_seed",
    "setup_env",
]

_LAUNCHERS = ("none", "pytorch")
#: the keys ``env_kwargs`` takes (the keyword arguments of :func:`setup_env`)
ENV_KWARGS = frozenset(
    {"launcher", "backend", "cudnn_benchmark", "mp_cfg", "dist_cfg", "resource_limit", "randomness"}
)
_RANDOMNESS_KEYS = frozenset({"seed", "deterministic", "diff_rank_seed"})


@dataclass(frozen=True)
class EnvInfo:
    """What :func:`setup_env` decided: launcher, backend, rank/world size, seed and the shared timestamp."""

    launcher: str
    backend: str | None
    rank: int
    world_size: int
    seed: int
    deterministic: bool
    diff_rank_seed: bool
    timestamp: str


def check_dict(name: str, value: Any, allowed: frozenset[str] | None = None) -> dict[str, Any]:
    """``value`` (a mapping or ``None``) as a new dict; ``allowed`` limits its keys. ``name`` is the option."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(f"{name} must be a dict, got {type(value).__name__}")
    if allowed is not None and set(value) - allowed:
        raise ValueError(f"{name}: unknown key(s) {sorted(set(value) - allowed)}; allowed: {sorted(allowed)}")
    return dict(value)


def is_distributed() -> bool:
    """Whether torch.distributed's default group is initialised (the one place this is decided)."""
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    """This process's rank in the default group (0 when not distributed)."""
    return dist.get_rank() if is_distributed() else 0


def get_world_size() -> int:
    """The default group's size (1 when not distributed)."""
    return dist.get_world_size() if is_distributed() else 1


def broadcast_object(obj: Any, src: int = 0, group: Any = None) -> Any:
    """Rank ``src``'s ``obj`` on every rank of ``group`` (default: the world; identity when not distributed)."""
    if get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def set_random_seed(
    seed: int | None = None, deterministic: bool = False, diff_rank_seed: bool = False
) -> int:
    """Seed python, numpy and torch; return the shared seed (``None``: drawn on rank 0 and broadcast)."""
    if seed is None:
        seed = broadcast_object(random.SystemRandom().randrange(2**31))
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"randomness seed must be a non-negative int or None, got {seed!r}")
    local = seed + get_rank() if diff_rank_seed else seed
    random.seed(local)
    try:
        import numpy as np
    except ImportError:  # numpy is optional
        pass
    else:
        np.random.seed(local % 2**32)
    torch.manual_seed(local)
    if deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    return seed


@functools.cache  # registered once, by whoever made the group here
def destroy_group_at_exit() -> None:
    """Destroy the default process group at exit: a gloo thread releasing the last reference to a tensor in a
    finalising interpreter aborts the process; from ``atexit`` the group joins its threads while it lives."""
    atexit.register(lambda: dist.destroy_process_group() if is_distributed() else None)


def _init_group(backend: str | None, dist_cfg: Mapping[str, Any]) -> str:
    if is_distributed():
        actual = dist.get_backend()
        if backend is not None and backend != actual:
            raise ValueError(f"env_kwargs backend={backend!r} but the process group already uses {actual!r}")
        return actual
    backend = backend or get_accelerator().communication_backend
    kwargs = {k: v for k, v in dist_cfg.items() if k != "backend"}
    if isinstance(kwargs.get("timeout"), int | float):
        kwargs["timeout"] = datetime.timedelta(seconds=kwargs["timeout"])
    if backend == "nccl" and torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, **kwargs)
    destroy_group_at_exit()
    return backend


def setup_env(
    *,
    launcher: str | None = None,
    backend: str | None = None,
    cudnn_benchmark: bool = False,
    mp_cfg: Mapping[str, Any] | None = None,
    dist_cfg: Mapping[str, Any] | None = None,
    resource_limit: int = 4096,
    randomness: Mapping[str, Any] | None = None,
) -> EnvInfo:
    """Set up the process as mmengine's ``_setup_env`` does (launcher, process group, cudnn, start method,
    ``RLIMIT_NOFILE``); the seed and the timestamp are drawn on rank 0."""
    dist_cfg = dict(dist_cfg or {})
    randomness = check_dict("env_kwargs['randomness']", randomness, _RANDOMNESS_KEYS)
    if launcher is None:  # torchrun's variables, or a group made by the caller
        torchrun = {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"} <= set(os.environ)
        launcher = "pytorch" if is_distributed() or torchrun else "none"
    if launcher not in _LAUNCHERS:
        raise ValueError(
            f"env_kwargs launcher must be one of {_LAUNCHERS} (slurm/mpi: start with torchrun), got {launcher!r}"
        )
    backend = backend or dist_cfg.get("backend")
    if mp_cfg and mp_cfg.get("mp_start_method"):
        import multiprocessing

        if multiprocessing.get_start_method(allow_none=True) != mp_cfg["mp_start_method"]:
            multiprocessing.set_start_method(mp_cfg["mp_start_method"], force=True)
    torch.backends.cudnn.benchmark = bool(cudnn_benchmark)
    used_backend = _init_group(backend, dist_cfg) if launcher == "pytorch" else None
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < resource_limit:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(resource_limit, hard), hard))
    except (ImportError, ValueError, OSError):  # not on this OS / not allowed: keep the limit
        pass
    timestamp = broadcast_object(time.strftime("%Y%m%d_%H%M%S", time.localtime()))
    deterministic = bool(randomness.get("deterministic", False))
    diff_rank_seed = bool(randomness.get("diff_rank_seed", False))
    seed = set_random_seed(randomness.get("seed"), deterministic, diff_rank_seed)
    rank, world = get_rank(), get_world_size()
    return EnvInfo(launcher, used_backend, rank, world, seed, deterministic, diff_rank_seed, timestamp)


LOG_KWARGS = frozenset({"log_level", "file_mode", "all_ranks", "console"})
_COUNTER = itertools.count()
_FORMAT = "%(asctime)s - %(name)s - %(levelname)s - %(message)s"


def setup_logger(
    experiment_name: str,
    log_dir: str,
    timestamp: str,
    *,
    rank: int = 0,
    log_level: str | int = "INFO",
    file_mode: str = "a",
    all_ranks: bool = False,
    console: bool = True,
) -> tuple[logging.Logger, str | None]:
    """A fresh logger and the path of its log file under ``log_dir`` (``None`` on ranks that write none)."""
    if file_mode not in ("a", "w"):
        raise ValueError(f"log_kwargs file_mode must be 'a' or 'w', got {file_mode!r}")
    level = logging.getLevelName(log_level.upper()) if isinstance(log_level, str) else log_level
    if not isinstance(level, int):
        raise ValueError(f"log_kwargs log_level must be a logging level name or number, got {log_level!r}")
    logger = logging.getLogger(f"stepforge.strategy.{experiment_name}.{next(_COUNTER)}")
    logger.setLevel(level)
    logger.propagate = False
    fmt = logging.Formatter(_FORMAT)
    path = None
    if rank == 0 or all_ranks:
        os.makedirs(log_dir, exist_ok=True)
        name = f"{timestamp}.log" if rank == 0 else f"{timestamp}_rank{rank}.log"
        path = os.path.join(log_dir, name)
        handlers: list[logging.Handler] = [logging.FileHandler(path, mode=file_mode, encoding="utf-8")]
        if console:
            handlers.append(logging.StreamHandler(sys.stderr))
        for handler in handlers:
            handler.setFormatter(fmt)
            handler.setLevel(level)
            logger.addHandler(handler)
    else:
        logger.addHandler(logging.NullHandler())
    return logger, path


def close_logger(logger: logging.Logger) -> None:
    """Close and detach the logger's handlers (the file is released)."""
    for handler in list(logger.handlers):
        handler.close()
        logger.removeHandler(handler)
