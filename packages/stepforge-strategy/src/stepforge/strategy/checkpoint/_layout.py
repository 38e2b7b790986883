# SPDX-License-Identifier: Apache-2.0
"""What a committed save is on disk, and how it is read and verified.

A committed directory ``<name>/`` holds the save's files and, written last, ``COMMIT.json``: the meta (iteration,
epoch, seed, versions, world size, plugin, kind), the commit time, the size and CRC-32 of every file and the
marker's own CRC-32. It is written under ``.<name>.tmp-<token>/`` and renamed to ``<name>/`` only after the marker
is on disk, so a directory without ``COMMIT.json`` was never produced by a finished save. A single file keeps its
own format where the user named it, with the same facts in a sidecar manifest ``<file>.stepforge.json``. Every
load checks sizes and CRC-32 (which detects every burst error up to 32 bits) before anything is read
(:func:`verify_dir`, :func:`verify_file`).
"""

from __future__ import annotations

import json
import os
import time
import zlib
from typing import Any

__all__ = [
    "FILE_FORMAT",
    "MARKER",
    "LAST_CHECKPOINT",
    "SIDECAR_SUFFIX",
    "CheckpointError",
    "CheckpointMismatchError",
    "commit_record",
    "commit_text",
    "committed_checkpoints",
    "file_record",
    "files_of",
    "find_latest_checkpoint",
    "fsync_dir",
    "fsync_file",
    "orphaned_copies",
    "read_commit",
    "read_torch_file",
    "verify_dir",
    "verify_file",
    "verify_save",
    "write_synced",
    "write_text_atomic",
]

MARKER = "COMMIT.json"
LAST_CHECKPOINT = "last_checkpoint"
FORMAT = "stepforge-dcp-2"
_CHUNK = 8 << 20
#: Sidecar manifest of a single-file save: ``model.pt`` -> ``model.pt.stepforge.json``.
SIDECAR_SUFFIX = ".stepforge.json"
FILE_FORMAT = "stepforge-file-1"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used: not committed, damaged, or written for another model."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """A sound checkpoint written for other live objects (another model, optimizer, plugin, scheduler list or
    world size); also a ``ValueError``, as the Booster's loads raised before."""


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


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: str, text: str) -> None:
    """Write ``text`` to ``path`` and fsync it."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def write_text_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file, fsync and ``os.replace``."""
    tmp = f"{path}.tmp-{os.getpid()}"
    write_synced(tmp, text)
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def files_of(folder: str) -> list[str]:
    """Every file below ``folder``, as sorted relative names."""
    out = []
    for root, _, names in os.walk(folder):
        out += [os.path.relpath(os.path.join(root, n), folder) for n in names]
    return sorted(out)


def _crc32(path: str) -> str:
    crc = 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"


def file_record(path: str) -> dict[str, Any]:
    """``{"size": bytes, "crc32": "8 hex digits"}`` of file ``path``, as ``COMMIT.json`` records it."""
    return {"size": os.path.getsize(path), "crc32": _crc32(path)}


def commit_record(folder: str, names: list[str], meta: dict[str, Any]) -> dict[str, Any]:
    """``COMMIT.json``'s record for files ``names`` of ``folder`` (before :func:`commit_text` adds its CRC-32)."""
    files = {n: file_record(os.path.join(folder, n)) for n in names}
    return {"format": FORMAT, "committed_at": time.time(), "files": files, "meta": meta}


def _canonical(record: dict[str, Any]) -> str:
    return json.dumps(record, sort_keys=True, separators=(",", ":"), default=str)


def commit_text(record: dict[str, Any]) -> str:
    """``COMMIT.json``'s text: ``record`` plus ``"crc32"`` of its canonical JSON, so a changed byte of the marker
    itself (a different iteration, size or checksum) is detected too."""
    body = {k: v for k, v in record.items() if k != "crc32"}
    return _canonical({**body, "crc32": f"{zlib.crc32(_canonical(body).encode()):08x}"})


def _is_file_record(record: Any) -> bool:
    return (
        isinstance(record, dict)
        and isinstance(record.get("size"), int)
        and isinstance(record.get("crc32"), str)
    )


def _read_record(file: str, fmt: str, owner: str) -> dict[str, Any]:
    """The JSON record in ``file`` (a marker or a manifest), checked to have format ``fmt`` and its own CRC-32."""
    what = f"{owner}: {os.path.basename(file)}"
    try:
        with open(file, encoding="utf-8") as f:
            text = f.read()
        record = json.loads(text)
    except (OSError, ValueError) as exc:  # ValueError: JSONDecodeError and UnicodeDecodeError
        raise CheckpointError(f"{what} is unreadable ({exc})") from exc
    if not isinstance(record, dict) or record.get("format") != fmt:
        found = record.get("format") if isinstance(record, dict) else type(record).__name__
        raise CheckpointError(f"{what} has format {found!r}, expected {fmt!r}")
    # byte for byte: a change that parses to the same values (a float's last digit) is damage too
    if commit_text(record) != text:
        raise CheckpointError(f"{owner} is damaged: {os.path.basename(file)} does not match its own CRC-32")
    return record


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
    record = _read_record(marker, FORMAT, f"checkpoint {path!r}")
    files = record.get("files")
    if (
        not isinstance(record.get("meta"), dict)
        or not isinstance(files, dict)
        or not all(_is_file_record(r) for r in files.values())
    ):
        raise CheckpointError(f"checkpoint {path!r}: {MARKER} is malformed (meta, files with size and crc32)")
    return record


def verify_dir(path: str, *, required: bool = True, where: str | None = None) -> dict[str, Any] | None:
    """The commit record of directory ``path`` once every file it lists is checked inside ``path`` and present
    with its recorded size and CRC-32 (sizes first, then checksums; unlisted files are never read). None when it
    has no marker and ``required`` is False (a directory stepforge did not write, such as a Hugging Face
    download); :class:`CheckpointError` naming the file otherwise, prefixed by ``where``."""
    if not os.path.isfile(os.path.join(path, MARKER)) and not required:
        return None
    try:
        record = read_commit(path)
        _check_files(path, record["files"], f"checkpoint {path!r}")
    except CheckpointError as exc:
        if where is None:
            raise
        raise CheckpointError(f"{where}: {exc}") from exc
    return record


def _check_files(path: str, files: dict[str, Any], owner: str) -> None:
    """Every file of ``files`` (name -> record, inside folder ``path``) is present with its recorded size, then
    its recorded CRC-32; :class:`CheckpointError` naming ``owner`` and the file otherwise."""
    root = os.path.realpath(path)
    for name in files:
        full = os.path.realpath(os.path.join(root, name))
        if os.path.commonpath([root, full]) != root:
            raise CheckpointError(f"{owner}: {MARKER} lists {name!r}, outside the checkpoint")
    for name, want in files.items():
        full = os.path.join(root, name)
        if not os.path.isfile(full):
            raise CheckpointError(f"{owner} is damaged: {name} is missing")
        actual = os.path.getsize(full)
        if actual != want["size"]:
            raise CheckpointError(
                f"{owner} is damaged: {name} has {actual} bytes, the save recorded {want['size']} "
                "(truncated or overwritten)"
            )
    for name, want in files.items():
        crc = _crc32(os.path.join(root, name))
        if crc != want["crc32"]:
            raise CheckpointError(
                f"{owner} is damaged: {name} has CRC-32 {crc}, the save recorded {want['crc32']} "
                "(bytes changed on disk after the save)"
            )


def _by_commit_time(folder: str, entries: list[str]) -> list[str]:
    """The committed checkpoints among ``folder``'s ``entries``, oldest commit first."""
    found = []
    for entry in entries:
        try:
            found.append((float(read_commit(os.path.join(folder, entry))["committed_at"]), entry))
        except (CheckpointError, KeyError, TypeError, ValueError):
            continue
    return [os.path.join(folder, entry) for _, entry in sorted(found)]


def committed_checkpoints(folder: str) -> list[str]:
    """The committed checkpoints directly inside ``folder``, oldest first."""
    if not os.path.isdir(folder):
        return []
    return _by_commit_time(folder, [e for e in os.listdir(folder) if not e.startswith(".")])


def orphaned_copies(path: str) -> list[str]:
    """Committed copies of checkpoint ``path`` under its dot-names, oldest first: a re-save killed between its two
    renames leaves the new one in ``.<name>.tmp-*`` (its ``COMMIT.json`` already written) and the older one in
    ``.<name>.old-*`` while ``<name>`` itself is missing. The next save of ``<name>`` renames the newest back."""
    parent, base = os.path.dirname(os.path.abspath(path)), os.path.basename(os.path.abspath(path))
    if not os.path.isdir(parent):
        return []
    dotted = [e for e in os.listdir(parent) if e.startswith((f".{base}.tmp-", f".{base}.old-"))]
    return _by_commit_time(parent, dotted)


def find_latest_checkpoint(work_dir: str) -> str | None:
    """The checkpoint ``work_dir/last_checkpoint`` names, if committed; else the newest committed copy of that
    name a re-save killed between its two renames left under a dot-name (:func:`orphaned_copies`); else the
    newest committed checkpoint of ``work_dir``; else None.
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
        if named and not os.path.exists(named):
            copies = orphaned_copies(named)
            if copies:
                return copies[-1]
    found = committed_checkpoints(work_dir)
    return found[-1] if found else None


def verify_file(path: str) -> dict[str, Any] | None:
    """Check single file ``path`` against its sidecar manifest before it is read; returns the manifest (``data``:
    size and CRC-32, ``meta``: what the save recorded), None when it has none (a file stepforge did not write);
    :class:`CheckpointError` naming the file otherwise."""
    sidecar = path + SIDECAR_SUFFIX
    if not os.path.isfile(sidecar):
        return None
    owner = f"checkpoint file {path!r}"
    record = _read_record(sidecar, FILE_FORMAT, owner)
    if not _is_file_record(record.get("data")):
        raise CheckpointError(f"{owner}: its manifest {sidecar!r} has no data size and crc32")
    _check_files(os.path.dirname(os.path.abspath(path)), {os.path.basename(path): record["data"]}, owner)
    return record


def verify_save(path: str, *, where: str | None = None) -> dict[str, Any] | None:
    """Check the save at ``path`` (a directory, its index JSON, or a single file) against its ``COMMIT.json`` or
    sidecar manifest before it is read; returns that record, None for a save stepforge did not write."""
    folder = os.path.dirname(path) if path.endswith(".index.json") else path
    if os.path.isdir(folder):
        return verify_dir(folder, required=False, where=where)
    return verify_file(path) if os.path.isfile(path) else None


def read_torch_file(path: str | os.PathLike[str], *, where: str, verify: bool = True) -> Any:
    """``torch.load`` of a single ``torch.save`` file, checked against its sidecar manifest first (unless the
    caller verified it), with ``weights_only=True`` (no code runs from it; :class:`CheckpointError` otherwise)
    and through a file object (``torch.load`` reads a path named ``*.safetensors`` as safetensors, and
    ColossalAI's users name asynchronous saves so)."""
    import torch

    if verify:
        verify_file(os.fspath(path))
    try:
        with open(path, "rb") as f:
            return torch.load(f, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as exc:
        raise CheckpointError(f"{where}: {os.fspath(path)} is unreadable or refused ({exc})") from exc
