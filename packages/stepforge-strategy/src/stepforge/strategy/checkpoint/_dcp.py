# SPDX-License-Identifier: Apache-2.0
"""Crash-safe directory checkpoints on torch.distributed.checkpoint (DCP).

:func:`save_dir` (collective): every rank writes its tensors (shards, never gathered) through ``dcp.save``, plus
one pickled blob of shared objects (deduplicated by DCP) and one of its own per-rank objects, into the one
writer's temporary directory (:func:`~stepforge.strategy.checkpoint._writer.commit_dir`). :func:`load_dir`
checks the marker, every file's size and CRC-32 and that the template's keys and shapes exist in the checkpoint
**before** anything is read, so a crashed, truncated, altered or foreign checkpoint raises
:class:`CheckpointError` and leaves the model and optimizer untouched.

No code runs from a checkpoint: ``.metadata`` is unpickled allowing only DCP's metadata classes
(:class:`stepforge.core.torch_compat.SafeFileSystemReader`), DCP's non-tensor entries and the blobs of objects are read with
``torch.load(weights_only=True)`` (:class:`stepforge.core.torch_compat.SafeLoadPlanner`, :func:`unblob`), and a blob that would
not load that way is refused at save time.

Loads read into fresh tensors (:func:`fresh_like`: uninitialised ones of the same shape, dtype, device and
sharding) and copy them into the live ones (:func:`apply_fresh`) only after every read succeeded: a load that
fails half-way leaves the live tensors alone, for one extra copy of the loaded tensors in memory.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from stepforge.core.torch_compat import SafeFileSystemReader, SafeLoadPlanner, flatten_state_dict

from .._env import get_rank, is_distributed
from ._layout import CheckpointError, CheckpointMismatchError, verify_dir
from ._writer import commit_dir

__all__ = [
    "apply_fresh",
    "check_template",
    "dcp_save",
    "fresh_like",
    "save_dir",
    "load_dir",
    "read_dir",
    "read_dcp_metadata",
    "safe_dcp_load",
]

#: Test hook: called as ``hook(rank)`` right after this rank's DCP data file is written (crash-safety tests).
_AFTER_WRITE_HOOK: Callable[[int], None] | None = None


class _Writer(dcp.FileSystemWriter):
    def write_data(self, plan: Any, planner: Any) -> Any:
        fut = super().write_data(plan, planner)
        if _AFTER_WRITE_HOOK is not None:
            fut.wait()
            _AFTER_WRITE_HOOK(get_rank())
        return fut


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


def safe_dcp_load(state: dict[str, Any], path: str, *, local: bool = False) -> None:
    """``dcp.load`` with the restricted reader and planner, collective when a process group exists unless
    ``local``; every failure (DCP's ``CheckpointException`` is a ``BaseException``) becomes
    :class:`CheckpointError`."""
    no_dist = local or not is_distributed()
    try:
        with _single_process_quiet():
            dcp.load(
                state, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner(), no_dist=no_dist
            )
    except (Exception, dcp.CheckpointException) as exc:
        raise CheckpointError(f"checkpoint {path!r}: reading its DCP data failed ({exc})") from exc


def save_dir(
    path: str,
    *,
    tensors: dict[str, Any],
    objects: dict[str, Any],
    rank_objects: dict[str, Any],
    meta: dict[str, Any],
    work_dir: str | None = None,
    max_keep_ckpts: int | None = None,
    arg: str = "filename",
    where: str = "save_checkpoint",
) -> str:
    """Write a committed checkpoint directory at ``path`` through :func:`commit_dir` (collective): ``tensors``
    (nested tensors/DTensors) for ``dcp.save``, ``objects`` shared by all ranks (saved once), this rank's
    ``rank_objects`` (RNG states, data position), ``meta`` recorded in ``COMMIT.json``."""
    # before any directory exists: an object a load could not read is refused with nothing left on disk
    state = {
        "tensors": tensors,
        "objects": _blob(objects, "shared objects (extra_ckpt, schedulers, statefuls)"),
        "rank_objects": {str(get_rank()): _blob(rank_objects, "per-rank objects (statefuls, RNG)")},
    }
    return commit_dir(
        path, partial(dcp_save, state), meta=meta, arg=arg, where=where, work_dir=work_dir,
        max_keep_ckpts=max_keep_ckpts,
    )  # fmt: skip


def dcp_save(state: dict[str, Any], directory: str, *, process_group: Any = None) -> None:
    """``dcp.save`` of ``state`` into ``directory``, the one writer's temporary directory (collective over
    ``process_group``, default the world, when a process group exists): every DCP write of Strategy and Booster."""
    with _single_process_quiet():
        dcp.save(
            state,
            storage_writer=_Writer(directory),
            process_group=process_group,
            no_dist=not is_distributed(),
        )


def check_template(path: str, template: dict[str, Any], metadata: Any, exact: Sequence[str] = ()) -> None:
    """Every template tensor is saved with the same shape and dtype (a floating-point one may differ in precision:
    the read casts it); under the roots named in ``exact`` the checkpoint holds nothing else either
    (``CheckpointMismatchError`` naming the first differences)."""
    flat, _ = flatten_state_dict({"tensors": template})
    stored = metadata.state_dict_metadata

    def shown(keys: list[str]) -> str:
        return ", ".join(k.removeprefix("tensors.") for k in keys[:5]) + (", ..." if len(keys) > 5 else "")

    missing = [k for k in flat if k not in stored]
    if missing:
        raise CheckpointMismatchError(
            f"checkpoint {path!r} does not match: {len(missing)} entries missing ({shown(missing)}); it was "
            "saved for another model or optimizer"
        )
    for root in exact:
        unexpected = [k for k in stored if k.startswith(f"tensors.{root}.") and k not in flat]
        if unexpected:
            raise CheckpointMismatchError(
                f"checkpoint {path!r} does not match: it holds {len(unexpected)} entries this {root} has no "
                f"place for ({shown(unexpected)}); it was saved for another {root}"
            )
    for key, value in flat.items():
        if isinstance(value, torch.Tensor):
            meta = stored[key]
            if not isinstance(meta, TensorStorageMetadata) or tuple(meta.size) != tuple(value.shape):
                shape = tuple(meta.size) if isinstance(meta, TensorStorageMetadata) else "an object"
                raise CheckpointMismatchError(
                    f"checkpoint {path!r} does not match: {key.removeprefix('tensors.')} has shape {shape} "
                    f"there and {tuple(value.shape)} here; it was saved for another model"
                )
            saved = meta.properties.dtype
            if saved != value.dtype and not (saved.is_floating_point and value.dtype.is_floating_point):
                # a floating-point tensor of another precision is cast by the read, as torch's load_state_dict
                raise CheckpointMismatchError(
                    f"checkpoint {path!r} does not match: {key.removeprefix('tensors.')} has dtype "
                    f"{meta.properties.dtype} there and {value.dtype} here; it was saved with another precision "
                    "or plugin"
                )


def read_dir(
    path: str, tensors: dict[str, Any], *, map_location: Any = "cpu", exact: Sequence[str] = ()
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any] | None]:
    """Read checkpoint ``path``, whose files the caller verified (:func:`verify_dir`), into fresh tensors shaped
    like ``tensors``; touch nothing live.

    Returns (fresh tensors, objects, rank objects). Checked first, in order: the DCP metadata, that every
    template tensor is saved with its shape and dtype (and, under the roots in ``exact``, nothing else is); then
    the object blobs are read, then the tensors. Any failure raises :class:`CheckpointError`. The rank objects
    are None when this rank has none (saved at a smaller world size); ``map_location`` applies to the pickled
    objects (tensors land where the template's live).
    """
    metadata = read_dcp_metadata(path)
    check_template(path, tensors, metadata, exact)
    rank_key = str(get_rank())
    blobs: dict[str, Any] = {"objects": b""}
    have_rank = f"rank_objects.{rank_key}" in metadata.state_dict_metadata
    if have_rank:
        blobs["rank_objects"] = {rank_key: b""}
    safe_dcp_load(blobs, path)  # the objects first: a bad blob fails before any tensor is read
    shared = unblob(blobs["objects"], map_location, path)
    mine = unblob(blobs["rank_objects"][rank_key], map_location, path) if have_rank else None
    for what, value in (("shared", shared), ("per-rank", mine)):
        if value is not None and not isinstance(value, dict):
            raise CheckpointError(
                f"checkpoint {path!r}: its {what} objects are {type(value).__name__}, not a dict"
            )
    fresh = fresh_like(tensors)
    if fresh:
        safe_dcp_load({"tensors": fresh}, path)
    return fresh, shared, mine


def load_dir(
    path: str, tensors: dict[str, Any], *, map_location: Any = "cpu"
) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any]]:
    """:func:`read_dir`, then the fresh tensors are copied into ``tensors`` in place; returns (objects, rank
    objects, meta). Any failure raises :class:`CheckpointError` with ``tensors`` unchanged."""
    meta = verify_dir(path)["meta"]  # type: ignore[index]  # required=True: the record or CheckpointError
    fresh, shared, mine = read_dir(path, tensors, map_location=map_location)
    apply_fresh(tensors, fresh)  # only now are the live tensors written
    return shared, mine, meta


def fresh_like(template: Any) -> Any:
    """``template`` with every tensor replaced by ``torch.empty_like`` (dicts and lists copied, leaves shared)."""
    if isinstance(template, torch.Tensor):
        return torch.empty_like(template)
    if isinstance(template, dict):
        return {k: fresh_like(v) for k, v in template.items()}
    if isinstance(template, list):
        return [fresh_like(v) for v in template]
    return template


@torch.no_grad()
def apply_fresh(template: Any, fresh: Any) -> None:
    """Copy ``fresh`` (filled by a load) into ``template`` in place: tensors with ``copy_``, other leaves set."""
    items: Any
    if isinstance(template, dict):
        items = template.items()
    elif isinstance(template, list):
        items = enumerate(template)
    else:
        return
    for key, live in list(items):
        new = fresh[key]
        if isinstance(live, torch.Tensor):
            live.copy_(new)
        elif isinstance(live, (dict, list)):
            apply_fresh(live, new)
        else:
            template[key] = new
