# SPDX-License-Identifier: Apache-2.0
"""A Strategy's logger: console at ``log_level`` on every rank, a file under ``work_dir/<timestamp>/``.

Rank 0 writes ``<timestamp>.log``; other ranks write ``<timestamp>_rank<r>.log`` only with
``log_kwargs=dict(all_ranks=True)``. Each strategy gets its own ``logging.Logger`` (named after its
experiment and a counter), so two strategies in one process never share handlers.
"""

from __future__ import annotations

import itertools
import logging
import os
import sys

__all__ = ["LOG_KWARGS", "setup_logger"]

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
    """A fresh logger and the path of its log file (None on ranks that write none).

    Args:
        experiment_name: shown in the logger name.
        log_dir: folder of the log file (created).
        timestamp: the run's shared timestamp (file name).
        rank: this process's rank.
        log_level: console and file level (name or number).
        file_mode: ``"a"`` (append, mmengine's default) or ``"w"``.
        all_ranks: every rank writes a file, not only rank 0.
        console: also log to stderr (rank 0, or every rank with ``all_ranks``).
    """
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
        handler = logging.FileHandler(path, mode=file_mode, encoding="utf-8")
        handler.setFormatter(fmt)
        handler.setLevel(level)
        logger.addHandler(handler)
        if console:
            stream = logging.StreamHandler(sys.stderr)
            stream.setFormatter(fmt)
            stream.setLevel(level)
            logger.addHandler(stream)
    else:
        logger.addHandler(logging.NullHandler())
    return logger, path


def close_logger(logger: logging.Logger) -> None:
    """Close and detach the logger's handlers (the file is released)."""
    for handler in list(logger.handlers):
        handler.close()
        logger.removeHandler(handler)
