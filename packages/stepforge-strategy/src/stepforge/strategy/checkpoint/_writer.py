# SPDX-License-Identifier: Apache-2.0
"""The one checkpoint writer: every save (Strategy and Booster) commits through :func:`commit_dir` or
:func:`commit_file`.

Directory saves (a Strategy checkpoint, ``Booster.save_optimizer``, ``Booster.save_model(shard=True)``):

1. rank 0 checks the name (:func:`check_target`), recovers a committed copy a kill left in a dot-directory, and
   makes ``.<name>.tmp-<token>/``;
2. the caller's ``write(tmp)`` runs on every rank (DCP writes every rank's shard; ``save_model`` writes on rank 0);
3. rank 0 writes ``COMMIT.json`` last (size and CRC-32 of every file, the meta, its own CRC-32), moves an older
   ``<name>/`` aside, renames the temporary directory to ``<name>/``, rewrites ``last_checkpoint``, deletes the
   older copy, then rotates (``max_keep_ckpts``) — rotation only ever follows a commit;
4. any failure (a full disk, a rank that raised) removes the temporary directory, puts an older ``<name>/`` back
   if it was already moved aside, and raises :class:`CheckpointError` on every rank, chained to the cause.

Single-file saves (``Booster.save_model(shard=False)``, ``save_lr_scheduler``, a plain optimizer's
``save_optimizer(shard=False)``) go through :func:`commit_file`: the file stays where the user named it, in its own
format (safetensors or ``torch.save``, readable by any reader of that format), with its size and CRC-32 in a
sidecar manifest ``<file>.stepforge.json`` (:data:`SIDECAR_SUFFIX`). Both are written to temporary names, fsynced
and ``os.replace``d, the file first, the manifest last (``_sidecar.py``); a file already at that path, whoever
wrote it, is replaced only by a complete new one (as ``torch.save`` and ColossalAI replace it, but atomically).

Saves of several files into a directory the user names (``Booster.save_model(shard=True)``, LoRA adapters) go
through :func:`commit_files`: a new or empty directory, or one holding only a stepforge save's files, is
committed as a whole as above; a directory holding other files (``config.json`` of the Hugging Face workflow)
receives this save's files one by one, its other files untouched (``_publish.py``).

Every save ends the same way on every rank: a failure on any rank raises the same :class:`CheckpointError` on
all of them at once (``_agree.py``), never leaving a rank in a later collective until the backend's timeout.

Which names a save may write to is ``_names.py``'s :func:`check_target`.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from .._env import broadcast_object, get_rank, is_distributed
from ._agree import on_rank0
from ._layout import (
    FORMAT,
    LAST_CHECKPOINT,
    MARKER,
    CheckpointError,
    commit_text,
    committed_checkpoints,
    file_record,
    fsync_dir,
    orphaned_copies,
    read_commit,
    validate_files,
    write_text_atomic,
)
from ._names import check_name, check_target, foreign_files, is_committed_dir
from ._publish import publish_files
from ._sidecar import FILE_FORMAT, SIDECAR_SUFFIX, verify_file, write_with_sidecar

__all__ = [
    "FILE_FORMAT",
    "SIDECAR_SUFFIX",
    "check_name",
    "check_target",
    "begin_dir",
    "commit_dir",
    "commit_dir_here",
    "commit_file",
    "commit_files",
    "commit_tmp_dir",
    "finish_dir",
    "is_committed_dir",
    "verify_dir",
    "verify_file",
    "write_file",
    "write_files",
]


def verify_dir(path: str, *, required: bool, where: str) -> bool:
    """Check directory ``path`` against its ``COMMIT.json`` (every listed file's size and CRC-32) before it is
    read. Returns False when it has no marker and ``required`` is False (a directory stepforge did not write, such
    as a Hugging Face download); raises :class:`CheckpointError` naming the file otherwise."""
    if not os.path.isfile(os.path.join(path, MARKER)) and not required:
        return False
    try:
        validate_files(path, read_commit(path))
    except CheckpointError as exc:
        raise CheckpointError(f"{where}: {exc}") from exc
    return True


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
    """Commit the complete temporary directory ``tmp`` as ``final`` (this process alone): ``COMMIT.json`` with
    every file's size and CRC-32, then the atomic rename (an existing ``final`` is moved aside first and deleted
    after), ``last_checkpoint`` in ``work_dir`` and rotation to ``max_keep`` committed checkpoints. On failure
    ``tmp`` is removed and an older ``final`` put back; the caller checked that ``final`` may be replaced."""
    files = {}
    for root, _, names in os.walk(tmp):
        for name in names:
            full = os.path.join(root, name)
            files[os.path.relpath(full, tmp)] = file_record(full)
    record = {"format": FORMAT, "committed_at": time.time(), "files": files, "meta": meta}
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
        stale = [p for _, p in done if os.path.abspath(p) != final]
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


def _gather_failures(status: str | None, group: Any = None) -> list[str]:
    if not is_distributed():
        return [status] if status else []
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, status, group=group)
    return [f"rank {r}: {s}" for r, s in enumerate(out) if s]


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
    """Write a committed checkpoint directory at ``path`` (collective: every rank calls it).

    Args:
        path: the directory to create (an older committed one is replaced only after the new one is committed).
        write: ``write(tmp_dir)`` writes this rank's files into the temporary directory (on every rank).
        meta: JSON-able facts recorded in ``COMMIT.json``.
        arg / where: the argument's name and the calling function, for error messages.
        work_dir: where ``last_checkpoint`` is rewritten after the commit (None: not written).
        max_keep_ckpts: keep at most this many committed checkpoints in ``path``'s folder, after the commit.

    Returns:
        The absolute path of the committed directory.

    Raises:
        ValueError / CheckpointError: a refused name (:func:`check_target`), on every rank.
        CheckpointError: a failed write or commit on any rank (temporary files removed, nothing committed before
            is touched), chained to this rank's own exception when it had one.
    """
    if max_keep_ckpts is not None and (
        not isinstance(max_keep_ckpts, int) or isinstance(max_keep_ckpts, bool)
    ):
        raise ValueError(f"max_keep_ckpts must be an int or None, got {max_keep_ckpts!r}")
    final, tmp = begin_dir(path, arg=arg, where=where, work_dir=work_dir)
    local: BaseException | None = None
    try:
        write(tmp)
    except (Exception, dcp.CheckpointException) as exc:  # DCP's CheckpointException is a BaseException
        local = _cause(exc, get_rank())
    return finish_dir(
        final, tmp, local, meta=meta, where=where, work_dir=work_dir, max_keep_ckpts=max_keep_ckpts
    )


def begin_dir(path: Any, *, arg: str, where: str, work_dir: str | None = None) -> tuple[str, str]:
    """First half of :func:`commit_dir` (collective): check the name, recover an orphaned copy, make the temporary
    directory; returns ``(final, tmp)`` on every rank. Every rank then writes into ``tmp`` and calls
    :func:`finish_dir`, at once or later (an asynchronous save)."""
    setup: tuple[str, str] | tuple[None, BaseException] = (None, CheckpointError("unset"))
    if get_rank() == 0:
        try:
            setup = _make_tmp(path, arg=arg, where=where, work_dir=work_dir)
        except (ValueError, TypeError, CheckpointError, OSError) as exc:
            setup = (None, exc)
    setup = broadcast_object(setup)
    if setup[0] is None:
        err = setup[1]
        if isinstance(err, OSError):
            raise CheckpointError(f"{where}: cannot create the checkpoint at {path!r} ({err})") from err
        raise err
    return setup[0], setup[1]


def _make_tmp(path: Any, *, arg: str, where: str, work_dir: str | None) -> tuple[str, str]:
    _recover(os.path.abspath(check_name(path, arg=arg, where=where)))
    final = check_target(path, arg=arg, where=where, kind="dir", work_dir=work_dir)
    os.makedirs(os.path.dirname(final), exist_ok=True)
    tmp = os.path.join(os.path.dirname(final), f".{os.path.basename(final)}.tmp-{uuid.uuid4().hex[:12]}")
    os.makedirs(tmp)
    return final, tmp


def finish_dir(
    final: str,
    tmp: str,
    local: BaseException | None,
    *,
    meta: dict[str, Any],
    where: str,
    work_dir: str | None = None,
    max_keep_ckpts: int | None = None,
    group: Any = None,
) -> str:
    """Second half of :func:`commit_dir` (collective over ``group``, default the world: a background writer
    passes its own): ``local`` is this rank's write failure (None when its files are complete). Commits when
    every rank succeeded; otherwise removes ``tmp`` and raises CheckpointError."""
    rank = get_rank()
    failures = _gather_failures(None if local is None else f"{type(local).__name__}: {local}", group)
    status = None
    if rank == 0:
        if failures:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            try:
                commit_tmp_dir(tmp, final, meta, work_dir, max_keep_ckpts)
            except Exception as exc:
                local, status = exc, f"rank 0: {type(exc).__name__}: {exc}"
    status = broadcast_object(status, group=group)
    problems = failures + ([status] if status else [])
    if problems:
        raise _failed(where, final, "; ".join(problems), local)
    return final


def _failed(where: str, final: str, what: str, cause: BaseException | None) -> CheckpointError:
    err = CheckpointError(
        f"{where}: saving {final!r} failed ({what}); nothing was committed and the previous checkpoint of that "
        "name, if any, is unchanged"
    )
    err.__cause__ = cause
    return err


def commit_dir_here(
    path: Any, write: Callable[[str], None], *, meta: dict[str, Any], arg: str, where: str
) -> str:
    """:func:`commit_dir` run by this process alone (no collective): for a save that one rank writes, possibly on
    a background thread (``Booster.save_model(use_async=True)``). Same steps, names and failure rules.

    Returns:
        The absolute path of the committed directory.
    """
    try:
        final, tmp = _make_tmp(path, arg=arg, where=where, work_dir=None)
    except OSError as exc:
        raise CheckpointError(f"{where}: cannot create the checkpoint at {path!r} ({exc})") from exc
    try:
        write(tmp)
        commit_tmp_dir(tmp, final, meta)
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise _failed(where, final, f"{type(exc).__name__}: {exc}", exc) from exc
    return final


def write_file(path: Any, write: Callable[[str], None], *, arg: str, where: str, meta: dict[str, Any]) -> str:
    """:func:`commit_file` in this process alone (no collective): check the name, write the file and its manifest.
    For rank 0's background writer of an asynchronous save (the name was checked when the save was called)."""
    final = check_target(path, arg=arg, where=where, kind="file")
    write_with_sidecar(final, write, where, meta)
    return final


def commit_file(
    path: Any, write: Callable[[str], None], *, arg: str, where: str, meta: dict[str, Any]
) -> str:
    """Write single file ``path`` and its sidecar manifest atomically (collective: rank 0 writes, every rank
    gets its outcome).

    ``write(tmp_path)`` writes the file in its own format (called on rank 0 only); the file is fsynced and its
    size and CRC-32 go to ``<path>.stepforge.json``, written after it. An existing file at ``path`` (whoever wrote
    it) is replaced only by the complete new one; a failure leaves it as it was, removes the temporary files and
    raises :class:`CheckpointError` chained to the cause, on every rank.

    Returns:
        The absolute path of the file.
    """
    return on_rank0(lambda: write_file(path, write, arg=arg, where=where, meta=meta), where=where)


def write_files(
    path: Any,
    write: Callable[[str], Sequence[str] | None],
    *,
    arg: str,
    where: str,
    meta: dict[str, Any],
    stale: Callable[[str], bool] | None = None,
) -> str:
    """:func:`commit_files` in this process alone (no collective), for rank 0 or its background writer.

    A new or empty directory, or one holding only a stepforge save's files, is committed as a whole
    (:func:`commit_dir_here`); a directory holding other files gets this save's files added (``_publish.py``:
    each file atomically in ``write``'s order, ``COMMIT.json`` last, the earlier save's files this one does not
    rewrite and the ``stale`` ones removed afterwards, nothing else touched).
    """
    final = check_target(path, arg=arg, where=where, kind="files")
    if os.path.isdir(final) and foreign_files(final):
        return publish_files(final, write, meta=meta, where=where, stale=stale)

    def into_tmp(tmp: str) -> None:
        write(tmp)

    return commit_dir_here(final, into_tmp, meta=meta, arg=arg, where=where)


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
    files of the user's (collective: rank 0 writes, every rank gets its outcome); see :func:`write_files`.

    Args:
        path: the directory (created when missing).
        write: ``write(tmp)`` writes this save's files into ``tmp`` and returns their names in the order they go
            live (an index last); called on rank 0 only.
        meta: JSON-able facts recorded in ``COMMIT.json``.
        stale: names a file of an earlier save of this kind (a shard) to remove when this save does not rewrite it.

    Returns:
        The absolute path of the directory.
    """
    return on_rank0(
        lambda: write_files(path, write, arg=arg, where=where, meta=meta, stale=stale), where=where
    )
