# SPDX-License-Identifier: Apache-2.0
"""Which names a save may write to. Never ``""``, ``"."``, ``".."``, ``work_dir``, the working directory or their
ancestors (directories the user did not name for this save). The path the user names is the save's: a file there is
replaced (atomically), a directory receives this save's files; a folder is replaced as a whole only when every file
in it is a stepforge save's, so a user's files are never deleted."""

from __future__ import annotations

import os
from typing import Any

from ._layout import MARKER, CheckpointError, read_commit

__all__ = ["check_name", "check_target", "foreign_files", "is_committed_dir"]


def is_committed_dir(path: str) -> bool:
    """Whether ``path`` is a directory with a readable stepforge ``COMMIT.json`` (its files are not checked: a
    damaged earlier save may be replaced)."""
    try:
        read_commit(path)
    except CheckpointError:
        return False
    return True


def _protected(target: str, work_dir: str | None) -> list[str]:
    """Directories a save must never replace: the working directory, ``work_dir`` and their ancestors."""
    out = [os.getcwd()]
    if work_dir is not None:
        out.append(os.path.abspath(work_dir))
    return [p for p in out if p == target or p.startswith(target.rstrip(os.sep) + os.sep)]


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
    out = []
    for root, _, names in os.walk(path):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), path)
            if rel != MARKER and rel not in listed:
                out.append(rel)
    return sorted(out)


def check_target(path: Any, *, arg: str, where: str, kind: str, work_dir: str | None = None) -> str:
    """The absolute path a save may write to, or a clear error naming ``arg`` and the fix.

    Always refused: ``""``, ``"."``, ``".."`` (or a path ending in them), the working directory, ``work_dir`` or
    any ancestor of them (directories the user did not name for this save). Then by ``kind``:

    - ``"file"``: a single file, replaced atomically whoever wrote it (what ``torch.save`` and ColossalAI do);
      an existing directory is refused (a file save never deletes a folder).
    - ``"dir"``: a directory replaced as a whole (a Strategy checkpoint, a DCP optimizer save): a new name, an
      empty directory, or one whose every file a stepforge commit lists; a directory holding anything else and an
      existing file are refused (a user's folder or file is never deleted).
    - ``"files"``: a directory this save adds its files to (a sharded model, LoRA adapters): a new name or any
      existing directory, whose other files stay (:func:`foreign_files`); an existing file is refused.
    """
    if kind not in ("file", "dir", "files"):
        raise ValueError(f"check_target: kind must be 'file', 'dir' or 'files', got {kind!r}")
    text = check_name(path, arg=arg, where=where)
    target = os.path.abspath(text)
    hit = _protected(target, work_dir)
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
