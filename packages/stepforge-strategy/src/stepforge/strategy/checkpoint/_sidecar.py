# SPDX-License-Identifier: Apache-2.0
"""Single-file saves: the file in its own format (safetensors or ``torch.save``) where the user named it, and its
size and CRC-32 in a sidecar manifest ``<file>.stepforge.json`` (JSON with its own CRC-32), both written to
temporary names, fsynced and ``os.replace``d, the file first, the manifest last."""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

from ._layout import CheckpointError, commit_text, file_record, fsync_dir

__all__ = [
    "FILE_FORMAT",
    "SIDECAR_SUFFIX",
    "read_manifest",
    "read_sidecar",
    "read_torch_file",
    "verify_file",
    "write_with_sidecar",
]

#: Sidecar manifest of a single-file save: ``model.pt`` → ``model.pt.stepforge.json``.
SIDECAR_SUFFIX = ".stepforge.json"
FILE_FORMAT = "stepforge-file-1"


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_sidecar(path: str) -> dict[str, Any] | None:
    """The ``{"size", "crc32"}`` record of single file ``path`` from its manifest; None when it has none;
    :class:`CheckpointError` when the manifest is damaged."""
    manifest = read_manifest(path)
    return None if manifest is None else manifest["data"]


def read_manifest(path: str) -> dict[str, Any] | None:
    """The whole manifest of single file ``path`` (``data``: size and CRC-32, ``meta``: what the save recorded,
    such as its kind); None when it has none; :class:`CheckpointError` when it is damaged."""
    sidecar = path + SIDECAR_SUFFIX
    if not os.path.isfile(sidecar):
        return None
    try:
        with open(sidecar, encoding="utf-8") as f:
            text = f.read()
        record = json.loads(text)
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"checkpoint file {path!r}: its manifest {sidecar!r} is unreadable ({exc})"
        ) from exc
    if not isinstance(record, dict) or record.get("format") != FILE_FORMAT or commit_text(record) != text:
        raise CheckpointError(
            f"checkpoint file {path!r}: its manifest {sidecar!r} is damaged or not a stepforge manifest "
            f"(format {FILE_FORMAT!r} with its own CRC-32)"
        )
    data = record.get("data")
    if (
        not isinstance(data, dict)
        or not isinstance(data.get("size"), int)
        or not isinstance(data.get("crc32"), str)
    ):
        raise CheckpointError(
            f"checkpoint file {path!r}: its manifest {sidecar!r} has no data size and crc32"
        )
    return record


def verify_file(path: str) -> bool:
    """Check single file ``path`` against its sidecar manifest before it is read.

    Returns False when the file has no manifest (a file not written by stepforge: a Hugging Face download, a
    ``torch.save`` of your own), True when it matched. Raises :class:`CheckpointError` naming the file when the
    size or CRC-32 differs or the manifest is damaged.
    """
    record = read_sidecar(path)
    if record is None:
        return False
    got = file_record(path)
    if got["size"] != record["size"]:
        raise CheckpointError(
            f"checkpoint file {path!r} is damaged: {got['size']} bytes, its manifest recorded {record['size']} "
            "(truncated or overwritten)"
        )
    if got["crc32"] != record["crc32"]:
        raise CheckpointError(
            f"checkpoint file {path!r} is damaged: CRC-32 {got['crc32']}, its manifest recorded {record['crc32']} "
            "(bytes changed on disk after the save)"
        )
    return True


def read_torch_file(path: str | os.PathLike[str], *, where: str, verify: bool = True) -> Any:
    """``torch.load`` of a single ``torch.save`` file, checked against its sidecar manifest first (when it has
    one), with ``weights_only=True`` (no code runs from it) and through a file object (``torch.load`` reads a
    path named ``*.safetensors`` as safetensors, and ColossalAI's users name asynchronous saves so).

    Raises:
        FileNotFoundError: no file there.
        CheckpointError: a damaged file, or one holding anything but tensors and plain containers.
    """
    import torch

    if verify:  # False: the caller checked it (a directory's COMMIT.json lists it)
        verify_file(os.fspath(path))
    try:
        with open(path, "rb") as f:
            return torch.load(f, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as exc:
        raise CheckpointError(f"{where}: {os.fspath(path)} is unreadable or refused ({exc})") from exc


def write_with_sidecar(final: str, write: Callable[[str], None], where: str, meta: dict[str, Any]) -> None:
    parent, base = os.path.dirname(final), os.path.basename(final)
    token = uuid.uuid4().hex[:12]
    tmp = os.path.join(parent, f".{base}.tmp-{token}")
    tmp_sidecar = os.path.join(parent, f".{base}{SIDECAR_SUFFIX}.tmp-{token}")
    try:
        os.makedirs(parent, exist_ok=True)
        write(tmp)
        _fsync_file(tmp)
        record = {
            "format": FILE_FORMAT,
            "file": base,
            "committed_at": time.time(),
            "data": file_record(tmp),  # "crc32" at the top level is the manifest's own (commit_text)
            "meta": meta,
        }
        with open(tmp_sidecar, "w", encoding="utf-8") as f:
            f.write(commit_text(record))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        os.replace(tmp_sidecar, final + SIDECAR_SUFFIX)
        fsync_dir(parent)
    except Exception as exc:
        for leftover in (tmp, tmp_sidecar):
            if os.path.lexists(leftover):
                os.remove(leftover)
        raise CheckpointError(f"{where}: writing {final!r} failed ({type(exc).__name__}: {exc})") from exc
