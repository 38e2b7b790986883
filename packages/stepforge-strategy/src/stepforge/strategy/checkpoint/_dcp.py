# SPDX-License-Identifier: Apache-2.0
"""Crash-safe directory checkpoints on torch.distributed.checkpoint (DCP).

:func:`save_dir` — every rank calls it (it is collective):

1. rank 0 picks a temporary sibling ``.<name>.tmp-<token>/`` (stale ones of the same name are removed);
2. every rank writes its tensors (model and optimizer shards, never gathered) through ``dcp.save``, plus one
   pickled blob of shared objects (deduplicated by DCP) and one blob of its own per-rank objects;
3. rank 0 records every file's size and CRC-32 and the meta in ``COMMIT.json`` (fsynced, written last), renames the
   directory to ``<name>/`` (an older ``<name>/`` is moved aside first and deleted after), then rewrites
   ``work_dir/last_checkpoint`` atomically, then deletes the oldest committed checkpoints beyond
   ``max_keep_ckpts``;
4. the outcome is broadcast, so a failure on rank 0 raises on every rank.

:func:`load_dir` checks the marker, every file's size and CRC-32 and that the template's keys and shapes exist
in the checkpoint **before** anything is read into memory, so a crashed, truncated, altered or foreign checkpoint
raises :class:`CheckpointError` and leaves the model and optimizer untouched.

No code runs from a checkpoint: ``.metadata`` is unpickled allowing only DCP's metadata classes
(:class:`stepforge.core.SafeFileSystemReader`), DCP's non-tensor entries and the blobs of objects are read with
``torch.load(weights_only=True)`` (:class:`stepforge.core.SafeLoadPlanner`, :func:`unblob`), and a blob that would
not load that way is refused at save time.
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

from stepforge.core import SafeFileSystemReader, SafeLoadPlanner, flatten_state_dict

from .._env import broadcast_object, get_rank
from ._layout import (
    FORMAT,
    LAST_CHECKPOINT,
    MARKER,
    CheckpointError,
    commit_text,
    committed_checkpoints,
    file_record,
    fsync_dir,
    read_commit,
    validate_files,
    write_text_atomic,
)
from ._staging import apply_fresh, fresh_like

__all__ = ["save_dir", "load_dir", "read_meta", "read_dcp_metadata", "safe_dcp_load", "unblob"]

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


def _blob(obj: Any, what: str) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    try:  # refuse now what a load could not read back (loads never unpickle arbitrary objects)
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:
        raise CheckpointError(
            f"save_checkpoint: the {what} hold an object torch.load(weights_only=True) cannot read ({exc}); "
            "store tensors and plain containers (dict, list, tuple, str, int, float, bool, None), or register "
            "the type with torch.serialization.add_safe_globals"
        ) from exc
    return data


def unblob(data: Any, map_location: Any, where: str) -> Any:
    """Objects saved by :func:`save_dir`, read with ``torch.load(weights_only=True)`` (``CheckpointError`` when
    the bytes name anything but tensors and plain containers: a checkpoint never runs code)."""
    if not isinstance(data, bytes):
        raise CheckpointError(f"checkpoint {where!r}: an object blob holds {type(data).__name__}, not bytes")
    try:
        return torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    except Exception as exc:
        raise CheckpointError(
            f"checkpoint {where!r}: refused to unpickle its objects ({exc}); only tensors and plain containers "
            "are read from a checkpoint"
        ) from exc


def read_dcp_metadata(path: str) -> Any:
    """DCP's ``Metadata`` of ``path`` through the restricted unpickler (``CheckpointError`` if refused/unreadable)."""
    try:
        return SafeFileSystemReader(path).read_metadata()
    except Exception as exc:
        raise CheckpointError(
            f"checkpoint {path!r}: its DCP metadata (.metadata) is unreadable or refused ({exc})"
        ) from exc


def safe_dcp_load(state: dict[str, Any], path: str, *, no_dist: bool) -> None:
    """``dcp.load`` with the restricted reader and planner; every failure (DCP's ``CheckpointException`` is a
    ``BaseException``) becomes :class:`CheckpointError`."""
    try:
        with _single_process_quiet():
            dcp.load(
                state, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner(), no_dist=no_dist
            )
    except (Exception, dcp.CheckpointException) as exc:
        raise CheckpointError(f"checkpoint {path!r}: reading its DCP data failed ({exc})") from exc


def _commit(tmp: str, final: str, meta: dict[str, Any], work_dir: str | None, max_keep: int | None) -> None:
    files = {}
    for root, _, names in os.walk(tmp):
        for name in names:
            full = os.path.join(root, name)
            files[os.path.relpath(full, tmp)] = file_record(full)
    record = {"format": FORMAT, "committed_at": time.time(), "files": files, "meta": meta}
    write_text_atomic(os.path.join(tmp, MARKER), commit_text(record))
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
    # before any directory exists: an object a load could not read is refused with nothing left on disk
    shared_blob = _blob(objects, "shared objects (extra_ckpt, schedulers, statefuls)")
    rank_blob = _blob(rank_objects, "per-rank objects (statefuls, RNG)")
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
        "objects": shared_blob,
        "rank_objects": {str(rank): rank_blob},
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
    complete: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[dict[str, Any] | None, dict[str, Any] | None, dict[str, Any]]:
    """Validate, then fill ``tensors`` in place from checkpoint ``path``; return (objects, rank objects, meta).

    Every file's size and CRC-32 is checked first, the objects are read next, the tensors are read into fresh
    tensors, and only then copied into ``tensors``: any failure raises :class:`CheckpointError` with
    ``tensors`` unchanged.

    ``rank_objects`` comes back None when this rank has none in the checkpoint (it was saved at a smaller
    world size). ``map_location`` applies to the pickled objects (tensors land where the template's live).
    ``complete(tensors)`` may adapt the template to the checkpoint once its files are verified, before the
    template is checked against it (an optimizer template gets exactly the saved state entries).
    """
    record = read_commit(path)
    validate_files(path, record)
    if complete is not None:
        complete(tensors)
    metadata = read_dcp_metadata(path)
    _check_template(path, tensors, metadata)
    rank_key = str(get_rank())
    blobs: dict[str, Any] = {}
    if objects:
        blobs["objects"] = b""
    have_rank = f"rank_objects.{rank_key}" in metadata.state_dict_metadata
    if rank_objects and have_rank:
        blobs["rank_objects"] = {rank_key: b""}
    no_dist = not _distributed()
    if blobs:  # the objects first: a refused or damaged blob fails before any tensor is read
        safe_dcp_load(blobs, path, no_dist=no_dist)
    shared = unblob(blobs["objects"], map_location, path) if objects else None
    mine = unblob(blobs["rank_objects"][rank_key], map_location, path) if rank_objects and have_rank else None
    fresh = fresh_like(tensors)
    safe_dcp_load({"tensors": fresh}, path, no_dist=no_dist)
    apply_fresh(tensors, fresh)  # only now are the live tensors written
    return shared, mine, record["meta"]


def barrier() -> None:
    """A barrier when distributed (no-op otherwise)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
