# SPDX-License-Identifier: Apache-2.0
"""A save of several files into a directory that holds other files (the Hugging Face workflow: ``config.json`` and
tokenizer files are already there when the sharded weights are saved).

The one writer (:func:`stepforge.strategy.checkpoint._writer.write_files`) commits a new or empty directory, or
one whose every file a stepforge commit lists, as a whole; a directory holding anything else comes here.
:func:`publish_files` runs in one process (rank 0, or its background writer). The caller's ``write(tmp)`` writes
this save's files into a private temporary directory inside the target and returns their names in the order they
go live (the index last). Each file is fsynced and renamed into place (a reader sees an old or a new file, never
half of one), in that order, then ``COMMIT.json`` listing exactly this save's files (size and CRC-32) is the last
write. Files of the earlier save of the same kind that this one no longer writes (the files its ``COMMIT.json``
listed, and the shards ``stale`` names, as transformers' ``save_pretrained`` removes them) are removed after that
commit; no other file is touched. A save killed half-way leaves the earlier ``COMMIT.json``, whose checksums then no longer
match the replaced files: a load says the checkpoint is damaged instead of reading a mix.

Any failure removes the temporary files and raises :class:`CheckpointError` chained to the cause.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from ._layout import FORMAT, MARKER, CheckpointError, commit_text, file_record, fsync_dir, read_commit

__all__ = ["TMP_PREFIX", "files_of", "publish_files"]

#: temporary directories of :func:`publish_files` inside the target (left only by a killed save; the next removes them)
TMP_PREFIX = ".stepforge-tmp-"


def files_of(folder: str) -> list[str]:
    """Every file below ``folder``, as sorted relative names."""
    out = []
    for root, _, names in os.walk(folder):
        out += [os.path.relpath(os.path.join(root, n), folder) for n in names]
    return sorted(out)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_files(
    final: str,
    write: Callable[[str], Sequence[str] | None],
    *,
    meta: dict[str, Any],
    where: str,
    stale: Callable[[str], bool] | None = None,
) -> str:
    """Add this save's files to the existing directory ``final`` (checked with ``check_target(kind="files")``).

    Args:
        final: the absolute target directory.
        write: ``write(tmp)`` writes the files into ``tmp`` and returns their names in publishing order (names it
            does not list follow in sorted order; None: all sorted).
        meta: JSON-able facts recorded in ``COMMIT.json``.
        where: the calling function, for error messages.
        stale: names an earlier save's file of this kind (a shard) that may go when this save does not write it.

    Returns:
        ``final``.
    """
    tmp = os.path.join(final, f"{TMP_PREFIX}{uuid.uuid4().hex[:12]}")
    for entry in os.listdir(final):  # a killed earlier save's temporary files
        if entry.startswith(TMP_PREFIX):
            shutil.rmtree(os.path.join(final, entry), ignore_errors=True)
    try:  # the earlier save of this kind (a model's shards, not an optimizer's files that share the folder)
        earlier = read_commit(final)
        same_kind = isinstance(earlier["meta"], dict) and earlier["meta"].get("kind") == meta.get("kind")
        previous = set(earlier["files"]) if same_kind else set()
    except CheckpointError:
        previous = set()
    try:
        os.makedirs(tmp)
        order = list(write(tmp) or [])
        names = files_of(tmp)
        unknown = sorted(set(order) - set(names))
        if unknown:
            raise CheckpointError(f"{where}: the writer named files it did not write: {unknown}")
        order += [n for n in names if n not in order]
        record = {
            "format": FORMAT,
            "committed_at": time.time(),
            "files": {n: file_record(os.path.join(tmp, n)) for n in names},
            "meta": meta,
        }
        for name in order:
            source, target = os.path.join(tmp, name), os.path.join(final, name)
            _fsync(source)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.replace(source, target)
        fsync_dir(final)
        marker = os.path.join(tmp, MARKER)
        with open(marker, "w", encoding="utf-8") as f:
            f.write(commit_text(record))
            f.flush()
            os.fsync(f.fileno())
        os.replace(marker, os.path.join(final, MARKER))
        fsync_dir(final)
    except Exception as exc:
        raise CheckpointError(
            f"{where}: saving into {final!r} failed ({type(exc).__name__}: {exc}); the directory's other files are "
            "unchanged"
        ) from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    # after the commit: the earlier save's files this one did not rewrite
    done = set(names)
    for entry in sorted(previous | set(files_of(final))):
        if (
            entry in done
            or entry == MARKER
            or not (entry in previous or (stale is not None and stale(entry)))
        ):
            continue
        path = os.path.join(final, entry)
        if os.path.isfile(path):
            os.remove(path)
    return final
