# SPDX-License-Identifier: Apache-2.0
"""Checkpoint directory layout, the commit marker, ``last_checkpoint`` and validation.

A committed checkpoint is a directory ``<name>/`` holding torch.distributed.checkpoint's files
(``.metadata`` and ``__<rank>_<i>.distcp``) and, written last, ``COMMIT.json``: the meta (iteration, epoch,
seed, experiment, versions, world size, plugin), the commit time, and the size of every file. It is written
under ``.<name>.tmp-<token>/`` and renamed to ``<name>/`` only after the marker is on disk, so a directory
named ``<name>`` without ``COMMIT.json`` was never produced by a finished save.
"""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = [
    "MARKER",
    "LAST_CHECKPOINT",
    "CheckpointError",
    "committed_checkpoints",
    "find_latest_checkpoint",
    "fsync_dir",
    "read_commit",
    "validate_files",
    "write_text_atomic",
]

MARKER = "COMMIT.json"
LAST_CHECKPOINT = "last_checkpoint"
FORMAT = "stepforge-dcp-1"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used: not committed, damaged, or written for another model."""


def fsync_dir(path: str) -> None:
    """Flush a directory entry (renames inside it) to disk where the OS supports it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_text_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file, fsync and ``os.replace``."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def read_commit(path: str) -> dict[str, Any]:
    """The commit record of checkpoint ``path``; :class:`CheckpointError` when it is not a committed checkpoint."""
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path!r} does not exist (or is not a directory)")
    marker = os.path.join(path, MARKER)
    if not os.path.isfile(marker):
        raise CheckpointError(
            f"checkpoint {path!r} has no {MARKER}: its save never finished (a crash mid-save). "
            f"Use the previous checkpoint (find_latest_checkpoint(work_dir) names the last committed one)"
        )
    try:
        with open(marker, encoding="utf-8") as f:
            record: dict[str, Any] = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"checkpoint {path!r}: {MARKER} is unreadable ({exc})") from exc
    if record.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path!r} has format {record.get('format')!r}, expected {FORMAT!r}")
    return record


def validate_files(path: str, record: dict[str, Any]) -> None:
    """Every file the commit lists is present with its recorded size (catches truncation and deletions)."""
    for name, size in record["files"].items():
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            raise CheckpointError(f"checkpoint {path!r} is damaged: {name} is missing")
        actual = os.path.getsize(full)
        if actual != size:
            raise CheckpointError(
                f"checkpoint {path!r} is damaged: {name} has {actual} bytes, the commit recorded {size} "
                "(truncated or overwritten)"
            )


def committed_checkpoints(folder: str) -> list[tuple[float, str]]:
    """``(commit time, path)`` of the committed checkpoints directly inside ``folder``, oldest first."""
    out: list[tuple[float, str]] = []
    if not os.path.isdir(folder):
        return out
    for entry in os.listdir(folder):
        full = os.path.join(folder, entry)
        if entry.startswith(".") or not os.path.isfile(os.path.join(full, MARKER)):
            continue
        try:
            out.append((float(read_commit(full)["committed_at"]), full))
        except (CheckpointError, KeyError, TypeError, ValueError):
            continue
    return sorted(out)


def find_latest_checkpoint(work_dir: str) -> str | None:
    """The checkpoint ``work_dir/last_checkpoint`` names, if committed; else the newest committed one; else None.

    ``last_checkpoint`` is only ever written after a commit, so the fallback matters only when it was removed or
    edited by hand.
    """
    named = None
    pointer = os.path.join(work_dir, LAST_CHECKPOINT)
    if os.path.isfile(pointer):
        with open(pointer, encoding="utf-8") as f:
            named = f.read().strip()
        if named and not os.path.isabs(named):
            named = os.path.join(work_dir, named)
        if named and os.path.isfile(os.path.join(named, MARKER)):
            return named
    found = committed_checkpoints(work_dir)
    return found[-1][1] if found else None
