# SPDX-License-Identifier: Apache-2.0
"""Crash-safe directory checkpoints on torch.distributed.checkpoint (DCP).

:func:`save_dir` — every rank calls it (it is collective):

1. rank 0 picks a temporary sibling ``.<name>.tmp-<token>/`` (stale ones of the same name are removed);
2. every rank writes its tensors (model and optimizer shards, never gathered) through ``dcp.save``, plus one
   pickled blob of shared objects (deduplicated by DCP) and one blob of its own per-rank objects;
3. rank 0 records every file's size and the meta in ``COMMIT.json`` (fsynced, written last), renames the
   directory to ``<name>/`` (an older ``<name>/`` is moved aside first and deleted after), then rewrites
   ``work_dir/last_checkpoint`` atomically, then deletes the oldest committed checkpoints beyond
   ``max_keep_ckpts``;
4. the outcome is broadcast, so a failure on rank 0 raises on every rank.

:func:`load_dir` checks the marker, every file's size and that the template's keys and shapes exist in the
checkpoint **before** anything is read into memory, so a crashed, truncated or foreign checkpoint raises
:class:`CheckpointError` and leaves the model and optimizer untouched.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from stepforge.core import flatten_state_dict

from .._env import broadcast_object, get_rank
from ._layout import (
    FORMAT,
    LAST_CHECKPOINT,
    MARKER,
    CheckpointError,
    committed_checkpoints,
    fsync_dir,
    read_commit,
    validate_files,
    write_text_atomic,
)

__all__ = ["save_dir", "load_dir", "read_meta"]

#: Test hook: called as ``hook(rank)`` right after this rank's DCP data file is written (crash-safety tests).
_AFTER_WRITE_HOOK: Callable[[int], None] | None = None


class _Writer(dcp.FileSystemWriter):
    def write_data(self, plan: Any, planner: Any) -> Any:
        fut = super().write_data(plan, planner)
        if _AFTER_WRITE_HOOK is not None:
            fut.wait()
            _AFTER_WRITE_HOOK(get_rank())
        return fut


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns on every call without a process group; one process is a supported case here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*single process")
        yield


def _blob(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unblob(data: bytes, map_location: Any) -> Any:
    return torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)


def _commit(tmp: str, final: str, meta: dict[str, Any], work_dir: str | None, max_keep: int | None) -> None:
    files = {}
    for root, _, names in os.walk(tmp):
        for name in names:
            full = os.path.join(root, name)
            files[os.path.relpath(full, tmp)] = os.path.getsize(full)
    record = {"format": FORMAT, "committed_at": time.time(), "files": files, "meta": meta}
    import json

    write_text_atomic(os.path.join(tmp, MARKER), json.dumps(record, indent=1, default=str))
    old = None
    if os.path.exists(final):
        old = f"{os.path.join(os.path.dirname(final), '.' + os.path.basename(final))}.old-{uuid.uuid4().hex[:8]}"
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(os.path.dirname(final))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    if work_dir is not None:
        os.makedirs(work_dir, exist_ok=True)
        write_text_atomic(os.path.join(work_dir, LAST_CHECKPOINT), os.path.abspath(final))
    if max_keep is not None and max_keep > 0:
        done = committed_checkpoints(os.path.dirname(final))
        keep = {os.path.abspath(final)}
        stale = [p for _, p in done if os.path.abspath(p) not in keep]
        for path in stale[: max(0, len(done) - max_keep)]:
            shutil.rmtree(path, ignore_errors=True)


def save_dir(
    path: str,
    *,
    tensors: dict[str, Any],
    objects: dict[str, Any],
    rank_objects: dict[str, Any],
    meta: dict[str, Any],
    work_dir: str | None = None,
    max_keep_ckpts: int | None = None,
) -> str:
    """Write a committed checkpoint directory at ``path`` (collective; see the module docstring).

    Args:
        path: the checkpoint directory to create (replaced if it exists, only after the new one is committed).
        tensors: nested dict of tensors/DTensors (and torch.optim-layout optimizer dicts) for ``dcp.save``.
        objects: picklable objects shared by all ranks (saved once).
        rank_objects: this rank's picklable objects (RNG states, data position), saved per rank.
        meta: JSON-able facts recorded in ``COMMIT.json`` and returned by :func:`read_meta`.
        work_dir: where ``last_checkpoint`` is rewritten after the commit (None: not written).
        max_keep_ckpts: keep at most this many committed checkpoints in ``path``'s folder (None/<=0: all).
    """
    if max_keep_ckpts is not None and (
        not isinstance(max_keep_ckpts, int) or isinstance(max_keep_ckpts, bool)
    ):
        raise ValueError(f"max_keep_ckpts must be an int or None, got {max_keep_ckpts!r}")
    final = os.path.abspath(path)
    rank = get_rank()
    tmp = None
    if rank == 0:
        parent = os.path.dirname(final)
        os.makedirs(parent, exist_ok=True)
        prefix = f".{os.path.basename(final)}.tmp-"
        for entry in os.listdir(parent):
            if entry.startswith(prefix):
                shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)
        tmp = os.path.join(parent, prefix + uuid.uuid4().hex[:12])
        os.makedirs(tmp)
    tmp = broadcast_object(tmp)
    state = {
        "tensors": tensors,
        "objects": _blob(objects),
        "rank_objects": {str(rank): _blob(rank_objects)},
    }
    with _single_process_quiet():
        dcp.save(state, storage_writer=_Writer(tmp), no_dist=not _distributed())
    status = None
    if rank == 0:
        try:
            _commit(tmp, final, meta, work_dir, max_keep_ckpts)
            status = "ok"
        except Exception as exc:
            status = f"{type(exc).__name__}: {exc}"
    status = broadcast_object(status)
    if status != "ok":
        raise CheckpointError(f"committing checkpoint {final!r} failed on rank 0: {status}")
    return final


def read_meta(path: str) -> dict[str, Any]:
    """The meta recorded in a committed checkpoint (``CheckpointError`` otherwise)."""
    meta: dict[str, Any] = read_commit(path)["meta"]
    return meta


def _check_template(path: str, template: dict[str, Any], metadata: Any) -> None:
    flat, _ = flatten_state_dict({"tensors": template})
    stored = metadata.state_dict_metadata
    missing = [k for k in flat if k not in stored]
    if missing:
        shown = ", ".join(m.removeprefix("tensors.") for m in missing[:5])
        raise CheckpointError(
            f"checkpoint {path!r} does not match: {len(missing)} entries missing ({shown}"
            f"{', ...' if len(missing) > 5 else ''}); it was saved for another model or optimizer"
        )
    for key, value in flat.items():
        if isinstance(value, torch.Tensor):
            meta = stored[key]
            if not isinstance(meta, TensorStorageMetadata) or tuple(meta.size) != tuple(value.shape):
                shape = tuple(meta.size) if isinstance(meta, TensorStorageMetadata) else "an object"
                raise CheckpointError(
                    f"checkpoint {path!r} does not match: {key.removeprefix('tensors.')} has shape {shape} "
                    f"there and {tuple(value.shape)} here; it was saved for another model"
                )


def load_dir(
    path: str,
    tensors: dict[str, Any],
    *,
    map_location: Any = "cpu",
    objects: bool = True,
    rank_objects: bool = True,
) -> tuple[dict[str, Any] | None, dict[str, Any] | None, dict[str, Any]]:
    """Validate, then fill ``tensors`` in place from checkpoint ``path``; return (objects, rank objects, meta).

    ``rank_objects`` comes back None when this rank has none in the checkpoint (it was saved at a smaller
    world size). ``map_location`` applies to the pickled objects (tensors land where the template's live).
    """
    record = read_commit(path)
    validate_files(path, record)
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as exc:
        raise CheckpointError(
            f"checkpoint {path!r} is damaged: its DCP metadata is unreadable ({exc})"
        ) from exc
    _check_template(path, tensors, metadata)
    rank_key = str(get_rank())
    state: dict[str, Any] = {"tensors": tensors}
    if objects:
        state["objects"] = b""
    have_rank = f"rank_objects.{rank_key}" in metadata.state_dict_metadata
    if rank_objects and have_rank:
        state["rank_objects"] = {rank_key: b""}
    with _single_process_quiet():
        dcp.load(state, storage_reader=dcp.FileSystemReader(path), no_dist=not _distributed())
    shared = _unblob(state["objects"], map_location) if objects else None
    mine = _unblob(state["rank_objects"][rank_key], map_location) if rank_objects and have_rank else None
    return shared, mine, record["meta"]


def barrier() -> None:
    """A barrier when distributed (no-op otherwise)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
