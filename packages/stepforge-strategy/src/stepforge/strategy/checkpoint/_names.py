# SPDX-License-Identifier: Apache-2.0
"""Which names a save may write to: never ``""``, ``"."``, ``".."``, ``work_dir``, the working directory or their
ancestors, and never an existing file or folder stepforge did not commit (a user's data is never replaced)."""

from __future__ import annotations

import os
from typing import Any

from ._layout import MARKER, CheckpointError, read_commit
from ._sidecar import SIDECAR_SUFFIX, read_sidecar

__all__ = ["check_name", "check_target", "is_committed_dir"]


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


def check_target(path: Any, *, arg: str, where: str, kind: str, work_dir: str | None = None) -> str:
    """The absolute path a save may write to, or a clear error naming ``arg`` and the fix.

    Refused: ``""``, ``"."``, ``".."`` (or a path ending in them), the working directory, ``work_dir`` or any
    ancestor of them, an existing directory that is not a committed stepforge checkpoint (an empty one is
    allowed: nothing is lost), an existing file that has no stepforge manifest (``kind="file"``), and for
    ``kind="dir"`` an existing file. A user's folder or file is never replaced.
    """
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
        if os.listdir(target) and not is_committed_dir(target):
            raise CheckpointError(
                f"{where}: {arg}={text!r} is an existing directory that is not a committed stepforge checkpoint "
                f"(no valid {MARKER}); it is never replaced. Choose another name or remove it yourself"
            )
    elif os.path.lexists(target):
        if kind == "dir":
            raise CheckpointError(
                f"{where}: {arg}={text!r} is an existing file, not a checkpoint directory stepforge committed; it "
                "is never replaced. Choose another name or remove it yourself"
            )
        try:
            has_manifest = read_sidecar(target) is not None
        except CheckpointError:
            has_manifest = False
        if not has_manifest:
            raise CheckpointError(
                f"{where}: {arg}={text!r} is an existing file stepforge did not write (no valid "
                f"{os.path.basename(target) + SIDECAR_SUFFIX}); it is never replaced. Choose another name or remove "
                "it yourself"
            )
    return target
