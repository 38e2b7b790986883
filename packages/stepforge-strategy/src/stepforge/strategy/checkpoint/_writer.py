# SPDX-License-Identifier: Apache-2.0
"""The one checkpoint writer: every save (Strategy and Booster) commits through :func:`commit_dir`,
:func:`commit_file` or :func:`commit_files`.

Directories (a Strategy checkpoint, a DCP optimizer save): (1) rank 0 checks the name (:func:`check_target`),
recovers a committed copy a kill left in a dot-directory, and makes ``.<name>.tmp-<token>/``; (2) the caller's
``write(tmp)`` runs on every rank; (3) rank 0 writes ``COMMIT.json`` last (size and CRC-32 of every file, the meta,
its own CRC-32), moves an older ``<name>/`` aside, renames the temporary directory to ``<name>/``, rewrites
``last_checkpoint``, deletes the older copy, then rotates (``max_keep_ckpts``): rotation only ever follows a
commit; (4) any failure (a full disk, a rank that raised) removes the temporary directory, puts an older
``<name>/`` back if it was already moved aside, and raises :class:`CheckpointError` on every rank.

Single files (a model with ``shard=False``, a scheduler, a one-file optimizer) stay where the user named them,
in their own format (readable by any reader of that format), with size and CRC-32 in a sidecar manifest
``<file>.stepforge.json``; both are written to temporary names, fsynced and ``os.replace``d, the file first, the
manifest last, so a file already there is replaced only by a complete new one (as ``torch.save`` and ColossalAI
replace it, but atomically). Several files into a directory the user names (sharded models, LoRA adapters): a
new or empty directory, or one holding only a stepforge save's files, is committed as a whole as above; one
holding other files (``config.json`` of the Hugging Face workflow) receives this save's files one by one, its
other files untouched (:func:`_publish`).

Every save ends the same way on every rank: a save only rank 0 writes runs through :func:`on_rank0` (the other
ranks raise the error rank 0 got, same type and text); a save where every rank worked ends in :func:`agree` (one
:class:`CheckpointError` naming every failed rank). No rank is left in a later collective until the backend's
timeout. Never written to: ``""``, ``"."``, ``".."``, ``work_dir``, the working directory or their ancestors; a
folder is replaced as a whole only when every file in it is a stepforge save's, so a user's files are never
deleted.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from .._env import broadcast_object, get_rank, is_distributed
from ._layout import (
    FILE_FORMAT,
    LAST_CHECKPOINT,
    MARKER,
    SIDECAR_SUFFIX,
    CheckpointError,
    commit_record,
    commit_text,
    committed_checkpoints,
    file_record,
    files_of,
    fsync_dir,
    fsync_file,
    orphaned_copies,
    read_commit,
    write_synced,
    write_text_atomic,
)

__all__ = [
    "agree",
    "begin_dir",
    "check_target",
    "commit_dir",
    "commit_file",
    "commit_files",
    "commit_tmp_dir",
    "describe",
    "finish_dir",
    "on_rank0",
    "write_file",
    "write_files",
]

T = TypeVar("T")

#: errors :func:`on_rank0` hands to the other ranks as they are (a name refused, a bad argument)
_PASSED_ON = (ValueError, TypeError, CheckpointError)


def describe(exc: BaseException) -> str:
    """``Type: message``, as the gathered failures name each rank's error."""
    return f"{type(exc).__name__}: {exc}"


def on_rank0(work: Callable[[], T], *, where: str, group: Any = None) -> T:
    """``work()`` on rank 0; every rank of ``group`` (default: the world) returns its result or raises its error.

    ``ValueError``, ``TypeError`` and :class:`CheckpointError` are raised as they are (the same type and text on
    every rank); anything else becomes a :class:`CheckpointError` naming ``where``, chained to the cause on rank 0.
    """
    outcome: Any = None
    if get_rank() == 0:
        try:
            outcome = ("ok", work())
        except _PASSED_ON as exc:
            outcome = ("raise", exc)
        except Exception as exc:
            wrapped = CheckpointError(f"{where}: {describe(exc)}")
            wrapped.__cause__ = exc
            outcome = ("raise", wrapped)
    if is_distributed():
        mine = outcome
        if outcome is not None and outcome[0] == "raise":
            # the exception travels pickled: a copy without cause or traceback (rank 0 keeps its chained one)
            try:
                outcome = ("raise", type(mine[1])(*mine[1].args))
            except Exception:  # an exception type with an unusual constructor
                outcome = ("raise", CheckpointError(describe(mine[1])))
        outcome = broadcast_object(outcome, group=group)
        if get_rank() == 0:
            outcome = mine
    kind, value = outcome
    if kind == "raise":
        raise value
    return value  # type: ignore[no-any-return]


def agree(local: BaseException | None, *, where: str, what: str, group: Any = None) -> None:
    """Collective over ``group`` (default: the world): raise one :class:`CheckpointError` on every rank when any
    rank's ``local`` is an error, naming each failed rank (``"rank 1: OSError: ..."``) and ``what`` failed."""
    status = None if local is None else describe(local)
    if is_distributed():
        statuses: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(statuses, status, group=group)
        failures = [f"rank {r}: {s}" for r, s in enumerate(statuses) if s]
    else:
        failures = [status] if status else []
    if failures:
        err = CheckpointError(f"{where}: {what} failed ({'; '.join(failures)})")
        err.__cause__ = local
        raise err


def is_committed_dir(path: str) -> bool:
    """Whether ``path`` is a directory with a readable stepforge ``COMMIT.json`` (its files are not checked: a
    damaged earlier save may be replaced)."""
    try:
        read_commit(path)
    except CheckpointError:
        return False
    return True


def check_name(path: Any, *, arg: str, where: str) -> str:
    """``path`` as text; ``TypeError``/``ValueError`` naming ``arg`` when it is not a path, empty, or names a
    directory by ``.`` or ``..`` (which a save would replace)."""
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"{where}: {arg} must be a str or os.PathLike, got {type(path).__name__}")
    text = os.fspath(path)
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{where}: {arg} is empty; pass a checkpoint name such as 'iter_100'")
    if os.path.basename(os.path.normpath(text)) in (".", "..", "") or text.rstrip("/\\").endswith(
        ("/.", "/..")
    ):
        raise ValueError(
            f"{where}: {arg}={text!r} names a directory by '.' or '..', which a save would replace; pass a new "
            "name such as 'iter_100'"
        )
    return text


def foreign_files(path: str) -> list[str]:
    """The files inside directory ``path`` (relative names, sorted) that no stepforge commit of it lists: a user's
    own files (``config.json``, a tokenizer...) or the files of an unfinished save. ``[]`` for an empty directory
    or one whose every file its ``COMMIT.json`` lists; a directory without a readable marker lists them all."""
    try:
        listed = set(read_commit(path)["files"])
    except CheckpointError:
        listed = set()
    return [n for n in files_of(path) if n != MARKER and n not in listed]


def check_target(path: Any, *, arg: str, where: str, kind: str, work_dir: str | None = None) -> str:
    """The absolute path a save may write to, or a clear error naming ``arg`` and the fix (see the module
    docstring). ``kind="file"``: a file, replaced atomically whoever wrote it; an existing directory is refused.
    ``"dir"``: a directory replaced as a whole: new, empty, or one whose every file a stepforge commit lists.
    ``"files"``: a directory this save adds its files to (:func:`foreign_files` stay). A user's folder or file
    is never deleted."""
    text = check_name(path, arg=arg, where=where)
    target = os.path.abspath(text)
    # never the working directory, work_dir or one of their ancestors
    protected = [os.getcwd()] if work_dir is None else [os.getcwd(), os.path.abspath(work_dir)]
    hit = [p for p in protected if p == target or p.startswith(target.rstrip(os.sep) + os.sep)]
    if hit:
        raise ValueError(
            f"{where}: {arg}={text!r} is {hit[0]!r} or one of its parent directories (the working or work_dir), "
            "which a save would replace; pass a name inside it such as 'iter_100'"
        )
    if os.path.isdir(target):
        if kind == "file":
            raise CheckpointError(
                f"{where}: {arg}={text!r} is an existing directory; pass a file path (or a new name)"
            )
        if kind == "dir" and os.listdir(target):
            if not is_committed_dir(target):
                raise CheckpointError(
                    f"{where}: {arg}={text!r} is an existing directory that is not a committed stepforge checkpoint "
                    f"(no valid {MARKER}); it is never replaced. Choose another name or remove it yourself"
                )
            others = foreign_files(target)
            if others:
                raise CheckpointError(
                    f"{where}: {arg}={text!r} is a stepforge checkpoint that also holds files no save of stepforge "
                    f"wrote ({others[:4]}); replacing it would delete them. Choose another name or move them"
                )
    elif os.path.lexists(target) and kind != "file":
        raise CheckpointError(
            f"{where}: {arg}={text!r} is an existing file, not a checkpoint directory stepforge committed; it "
            "is never replaced. Choose another name or remove it yourself"
        )
    return target


def _recover(final: str) -> None:
    """Bring back a committed copy a kill left under a dot-name (between the two renames of a re-save), and
    remove the other leftovers of ``final``'s earlier saves (unfinished temporary or already replaced copies)."""
    parent, base = os.path.dirname(final), os.path.basename(final)
    if not os.path.isdir(parent):
        return
    if not os.path.exists(final):
        copies = orphaned_copies(final)
        if copies:
            os.replace(copies[-1], final)
            fsync_dir(parent)
    if os.path.exists(final) and not is_committed_dir(final):
        return  # not ours: check_target refuses it; its leftovers are kept for inspection
    for entry in os.listdir(parent):
        if entry.startswith((f".{base}.tmp-", f".{base}.old-")):
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)


def commit_tmp_dir(
    tmp: str, final: str, meta: dict[str, Any], work_dir: str | None = None, max_keep: int | None = None
) -> None:
    """Commit the complete temporary directory ``tmp`` as ``final`` (this process alone; steps 3-4 of the module
    docstring); the caller checked that ``final`` may be replaced."""
    record = commit_record(tmp, files_of(tmp), meta)
    parent = os.path.dirname(final)
    old = None
    try:
        write_text_atomic(os.path.join(tmp, MARKER), commit_text(record))
        if os.path.exists(final):
            old = os.path.join(parent, f".{os.path.basename(final)}.old-{uuid.uuid4().hex[:8]}")
            os.replace(final, old)
        os.replace(tmp, final)
    except Exception:
        if old is not None and not os.path.exists(final):
            os.replace(old, final)  # the earlier commit goes back where it was
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(parent)
    if work_dir is not None:
        os.makedirs(work_dir, exist_ok=True)
        write_text_atomic(os.path.join(work_dir, LAST_CHECKPOINT), final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    if max_keep is not None and max_keep > 0:
        done = committed_checkpoints(parent)
        stale = [p for p in done if os.path.abspath(p) != final]
        for path in stale[: max(0, len(done) - max_keep)]:
            shutil.rmtree(path, ignore_errors=True)


def _cause(exc: BaseException, rank: int) -> BaseException:
    """The exception to chain to: for DCP's ``CheckpointException`` (which wraps every rank's failure with its
    traceback) this rank's own, else the first rank's."""
    if isinstance(exc, dcp.CheckpointException) and exc.failures:
        wrapped = exc.failures.get(rank) or next(iter(exc.failures.values()))
        inner: BaseException = wrapped[0]
        if inner.__cause__ is None and inner is not exc:
            inner.__context__ = exc
        return inner
    return exc


def commit_dir(
    path: Any,
    write: Callable[[str], None],
    *,
    meta: dict[str, Any],
    arg: str,
    where: str,
    work_dir: str | None = None,
    max_keep_ckpts: int | None = None,
) -> str:
    """Write a committed checkpoint directory at ``path`` (collective; see the module docstring); returns its
    absolute path. ``write(tmp)`` writes this rank's files on every rank; ``arg``/``where`` name the argument and
    the caller in errors; ``work_dir`` gets ``last_checkpoint``; ``max_keep_ckpts`` rotates after the commit. A
    refused name or a failure on any rank raises on every rank, chained to this rank's own exception."""
    if max_keep_ckpts is not None and (
        not isinstance(max_keep_ckpts, int) or isinstance(max_keep_ckpts, bool)
    ):
        raise ValueError(f"max_keep_ckpts must be an int or None, got {max_keep_ckpts!r}")
    final, tmp = begin_dir(path, arg=arg, where=where, work_dir=work_dir)
    return finish_dir(
        final, tmp, write, meta=meta, where=where, work_dir=work_dir, max_keep_ckpts=max_keep_ckpts
    )


def begin_dir(path: Any, *, arg: str, where: str, work_dir: str | None = None) -> tuple[str, str]:
    """First half of :func:`commit_dir` (collective): ``(final, tmp)`` on every rank, which then write into
    ``tmp`` and call :func:`finish_dir`, at once or later (an asynchronous save)."""
    return on_rank0(lambda: _make_tmp(path, arg=arg, where=where, work_dir=work_dir), where=where)


def _make_tmp(path: Any, *, arg: str, where: str, work_dir: str | None) -> tuple[str, str]:
    try:
        _recover(os.path.abspath(check_name(path, arg=arg, where=where)))
        final = check_target(path, arg=arg, where=where, kind="dir", work_dir=work_dir)
        os.makedirs(os.path.dirname(final), exist_ok=True)
        tmp = os.path.join(os.path.dirname(final), f".{os.path.basename(final)}.tmp-{uuid.uuid4().hex[:12]}")
        os.makedirs(tmp)
    except OSError as exc:
        raise CheckpointError(f"{where}: cannot create the checkpoint at {path!r} ({exc})") from exc
    return final, tmp


def finish_dir(
    final: str,
    tmp: str,
    write: Callable[[str], None],
    *,
    meta: dict[str, Any],
    where: str,
    work_dir: str | None = None,
    max_keep_ckpts: int | None = None,
    group: Any = None,
) -> str:
    """Second half of :func:`commit_dir` (collective over ``group``, default the world): ``write(tmp)`` on this
    rank, then rank 0 commits when no rank failed."""
    local: BaseException | None = None
    try:
        write(tmp)
    except (Exception, dcp.CheckpointException) as exc:  # DCP's CheckpointException is a BaseException
        local = _cause(exc, get_rank())
    try:
        agree(local, where=where, what=f"saving {final!r}", group=group)
    except CheckpointError:
        if get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise

    def commit() -> None:
        try:
            commit_tmp_dir(tmp, final, meta, work_dir, max_keep_ckpts)
        except Exception as exc:
            raise _failed(where, final, describe(exc), exc) from exc

    on_rank0(commit, where=where, group=group)
    return final


def _failed(where: str, final: str, what: str, cause: BaseException | None) -> CheckpointError:
    err = CheckpointError(
        f"{where}: saving {final!r} failed ({what}); nothing was committed and the previous checkpoint of that "
        "name, if any, is unchanged"
    )
    err.__cause__ = cause
    return err


def write_file(path: Any, write: Callable[[str], None], *, arg: str, where: str, meta: dict[str, Any]) -> str:
    """:func:`commit_file` in this process alone (no collective), for rank 0 or its background writer."""
    final = check_target(path, arg=arg, where=where, kind="file")
    parent, base = os.path.dirname(final), os.path.basename(final)
    token = uuid.uuid4().hex[:12]
    tmp = os.path.join(parent, f".{base}.tmp-{token}")
    tmp_sidecar = os.path.join(parent, f".{base}{SIDECAR_SUFFIX}.tmp-{token}")
    try:
        os.makedirs(parent, exist_ok=True)
        write(tmp)
        fsync_file(tmp)
        record = {
            "format": FILE_FORMAT,
            "file": base,
            "committed_at": time.time(),
            "data": file_record(tmp),  # "crc32" at the top level is the manifest's own (commit_text)
            "meta": meta,
        }
        write_synced(tmp_sidecar, commit_text(record))
        os.replace(tmp, final)
        os.replace(tmp_sidecar, final + SIDECAR_SUFFIX)
        fsync_dir(parent)
    except Exception as exc:
        for leftover in (tmp, tmp_sidecar):
            if os.path.lexists(leftover):
                os.remove(leftover)
        raise CheckpointError(f"{where}: writing {final!r} failed ({describe(exc)})") from exc
    return final


def commit_file(
    path: Any, write: Callable[[str], None], *, arg: str, where: str, meta: dict[str, Any]
) -> str:
    """Write single file ``path`` and its sidecar manifest atomically (collective: ``write(tmp_path)`` writes
    the file in its own format on rank 0, every rank gets the outcome); returns its absolute path."""
    return on_rank0(lambda: write_file(path, write, arg=arg, where=where, meta=meta), where=where)


#: temporary directories of :func:`_publish` inside the target (left only by a killed save; the next removes them)
_PUBLISH_TMP = ".stepforge-tmp-"


def _publish(
    final: str,
    write: Callable[[str], Sequence[str] | None],
    *,
    meta: dict[str, Any],
    where: str,
    stale: Callable[[str], bool] | None,
) -> str:
    """Add this save's files to the existing directory ``final``, which holds the user's files. Each is fsynced
    and renamed into place in ``write``'s order (a reader sees an old or a new file, never half of one), then
    ``COMMIT.json`` listing exactly this save's files; the earlier save of this kind's files it did not rewrite
    (and ``stale`` ones, as transformers' ``save_pretrained`` removes shards) go after. A save killed half-way
    leaves the earlier ``COMMIT.json``, whose checksums no longer match: a load says damaged, never reads a mix."""
    tmp = os.path.join(final, f"{_PUBLISH_TMP}{uuid.uuid4().hex[:12]}")
    for entry in os.listdir(final):  # a killed earlier save's temporary files
        if entry.startswith(_PUBLISH_TMP):
            shutil.rmtree(os.path.join(final, entry), ignore_errors=True)
    try:  # the earlier save of this kind (a model's shards, not an optimizer's files that share the folder)
        earlier = read_commit(final)
        previous = set(earlier["files"]) if earlier["meta"].get("kind") == meta.get("kind") else set()
    except CheckpointError:
        previous = set()
    try:
        os.makedirs(tmp)
        order = list(write(tmp) or [])
        names = files_of(tmp)
        order += [n for n in names if n not in order]
        record = commit_record(tmp, names, meta)
        for name in order:
            source, target = os.path.join(tmp, name), os.path.join(final, name)
            fsync_file(source)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.replace(source, target)
        fsync_dir(final)
        marker = os.path.join(tmp, MARKER)
        write_synced(marker, commit_text(record))
        os.replace(marker, os.path.join(final, MARKER))
        fsync_dir(final)
    except Exception as exc:
        raise CheckpointError(
            f"{where}: saving into {final!r} failed ({describe(exc)}); the directory's other files are unchanged"
        ) from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    done = set(names)
    for entry in sorted(previous | set(files_of(final))):
        if (
            entry in done
            or entry == MARKER
            or not (entry in previous or (stale is not None and stale(entry)))
        ):
            continue
        if os.path.isfile(os.path.join(final, entry)):
            os.remove(os.path.join(final, entry))
    return final


def write_files(
    path: Any,
    write: Callable[[str], Sequence[str] | None],
    *,
    arg: str,
    where: str,
    meta: dict[str, Any],
    stale: Callable[[str], bool] | None = None,
) -> str:
    """:func:`commit_files` in this process alone (rank 0 or its background writer). ``write(tmp)`` writes the
    files and returns their names in the order they go live (an index last); ``stale`` names an earlier save's
    file (a shard) to remove when this one does not rewrite it."""
    final = check_target(path, arg=arg, where=where, kind="files")
    if os.path.isdir(final) and foreign_files(final):
        return _publish(final, write, meta=meta, where=where, stale=stale)
    final, tmp = _make_tmp(final, arg=arg, where=where, work_dir=None)
    try:
        write(tmp)
        commit_tmp_dir(tmp, final, meta)
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise _failed(where, final, describe(exc), exc) from exc
    return final


def commit_files(
    path: Any,
    write: Callable[[str], Sequence[str] | None],
    *,
    arg: str,
    where: str,
    meta: dict[str, Any],
    stale: Callable[[str], bool] | None = None,
) -> str:
    """Save several files (shards and their index, LoRA adapters) into directory ``path``, which may already hold
    the user's files (collective: rank 0 writes, every rank gets the outcome); see :func:`write_files`."""
    return on_rank0(
        lambda: write_files(path, write, arg=arg, where=where, meta=meta, stale=stale), where=where
    )
