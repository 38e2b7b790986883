# SPDX-License-Identifier: Apache-2.0
"""``Strategy(resume="auto")``: which checkpoint to resume, after removing what killed saves left behind.

A process killed before a save's renames leaves ``.<name>.tmp-<token>/`` and ``last_checkpoint.tmp-<pid>``, which
no load reads and which would pile up with every fault. Only entries of those two shapes are removed (committed
checkpoints and the ``.<name>.old-<token>`` copy a re-save moves aside stay), on one rank, before training.
"""

from __future__ import annotations

import logging
import os
import re
import shutil

from .._env import broadcast_object, get_rank
from ._layout import LAST_CHECKPOINT, find_latest_checkpoint

__all__ = ["check_resume_option", "checkpoint_to_resume", "remove_uncommitted"]

_TMP_DIR = re.compile(r"^\..+\.tmp-[0-9a-f]+$")
_TMP_POINTER = re.compile(rf"^{re.escape(LAST_CHECKPOINT)}\.tmp-\d+$")


def remove_uncommitted(folder: str) -> list[str]:
    """Delete the unfinished saves' temporary directories and the temporary ``last_checkpoint`` files directly
    inside ``folder``; returns the removed paths (sorted)."""
    removed: list[str] = []
    if not os.path.isdir(folder):
        return removed
    for entry in sorted(os.listdir(folder)):
        full = os.path.join(folder, entry)
        if os.path.islink(full):
            continue
        if _TMP_DIR.match(entry) and os.path.isdir(full):
            shutil.rmtree(full, ignore_errors=True)
            removed.append(full)
        elif _TMP_POINTER.match(entry) and os.path.isfile(full):
            os.remove(full)
            removed.append(full)
    return removed


def check_resume_option(option: object) -> None:
    """``TypeError`` naming ``resume`` unless ``option`` is a bool or a non-empty string."""
    if not isinstance(option, bool | str) or option == "":
        raise TypeError(
            f"Strategy: resume must be False, 'auto' (resume from the latest checkpoint of work_dir if any), "
            f"True (the same) or a checkpoint path, got {option!r}"
        )


def checkpoint_to_resume(option: bool | str, work_dir: str, logger: logging.Logger) -> str | None:
    """The checkpoint ``Strategy(resume=option)`` resumes (collective, before training): for ``"auto"``/``True``
    rank 0 removes the unfinished saves of ``work_dir`` and picks ``find_latest_checkpoint(work_dir)`` for every
    rank (``None``: start fresh), also after an elastic restart at another world size; another string is the
    path itself; ``False`` gives ``None``."""
    if option is False:
        return None
    if option is not True and option != "auto":
        return str(option)
    latest = None
    if get_rank() == 0:
        for removed in remove_uncommitted(work_dir):
            logger.info(f"resume='auto': removed {removed} (left by a save that did not finish)")
        latest = find_latest_checkpoint(work_dir)
    path: str | None = broadcast_object(latest)  # every rank resumes the one rank 0 found
    if path is None:
        logger.info("resume='auto': no committed checkpoint in work_dir, training from scratch")
    return path
