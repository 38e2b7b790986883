# SPDX-License-Identifier: Apache-2.0
"""Checkpoint directory layout, the commit marker, ``last_checkpoint`` and validation.

A committed checkpoint is a directory ``<name>/`` holding torch.distributed.checkpoint's files
(``.metadata`` and ``__<rank>_<i>.distcp``) and, written last, ``COMMIT.json``: the meta (iteration, epoch,
seed, experiment, versions, world size, plugin), the commit time, and the size and CRC-32 of every file
(:func:`file_record`). Every load checks both for every file before anything is read (:func:`validate_files`);
CRC-32 detects every burst error up to 32 bits, so every flipped byte. It is written
under ``.<name>.tmp-<token>/`` and renamed to ``<name>/`` only after the marker is on disk, so a directory
named ``<name>`` without ``COMMIT.json`` was never produced by a finished save.
"""

from __future__ import annotations

import json
import os
import zlib
from typing import Any

__all__ = [
    "MARKER",
    "LAST_CHECKPOINT",
    "CheckpointError",
    "CheckpointMismatchError",
    "commit_text",
    "committed_checkpoints",
    "file_record",
    "find_latest_checkpoint",
    "fsync_dir",
    "orphaned_copies",
    "read_commit",
    "validate_files",
    "write_text_atomic",
]

MARKER = "COMMIT.json"
LAST_CHECKPOINT = "last_checkpoint"
FORMAT = "stepforge-dcp-2"
_CHUNK = 8 << 20


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


def write_text_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file, fsync and ``os.replace``."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


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


def _canonical(record: dict[str, Any]) -> str:
    return json.dumps(record, sort_keys=True, separators=(",", ":"), default=str)


def commit_text(record: dict[str, Any]) -> str:
    """``COMMIT.json``'s text: ``record`` plus ``"crc32"`` of its canonical JSON, so a changed byte of the marker
    itself (a different iteration, size or checksum) is detected too."""
    body = {k: v for k, v in record.items() if k != "crc32"}
    return _canonical({**body, "crc32": f"{zlib.crc32(_canonical(body).encode()):08x}"})


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
    try:
        with open(marker, encoding="utf-8") as f:
            text = f.read()
        record = json.loads(text)
    except (OSError, ValueError) as exc:  # ValueError: JSONDecodeError and UnicodeDecodeError
        raise CheckpointError(f"checkpoint {path!r}: {MARKER} is unreadable ({exc})") from exc
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        found = record.get("format") if isinstance(record, dict) else type(record).__name__
        raise CheckpointError(f"checkpoint {path!r}: {MARKER} has format {found!r}, expected {FORMAT!r}")
    # byte for byte: a change that parses to the same values (a float's last digit) is damage too
    if commit_text(record) != text:
        raise CheckpointError(f"checkpoint {path!r} is damaged: {MARKER} does not match its own CRC-32")
    files = record.get("files")
    if (
        not isinstance(record.get("meta"), dict)
        or not isinstance(files, dict)
        or not all(
            isinstance(r, dict) and isinstance(r.get("size"), int) and isinstance(r.get("crc32"), str)
            for r in files.values()
        )
    ):
        raise CheckpointError(f"checkpoint {path!r}: {MARKER} is malformed (meta, files with size and crc32)")
    return record


def validate_files(path: str, record: dict[str, Any]) -> None:
    """Every file the commit lists is inside ``path`` and present with its recorded size and CRC-32 (truncation,
    deletion, flipped bytes); sizes first (cheap), then checksums. Files the commit does not list are never read."""
    root = os.path.realpath(path)
    for name in record["files"]:
        full = os.path.realpath(os.path.join(root, name))
        if os.path.commonpath([root, full]) != root:
            raise CheckpointError(f"checkpoint {path!r}: {MARKER} lists {name!r}, outside the checkpoint")
    for name, want in record["files"].items():
        full = os.path.join(root, name)
        if not os.path.isfile(full):
            raise CheckpointError(f"checkpoint {path!r} is damaged: {name} is missing")
        actual = os.path.getsize(full)
        if actual != want["size"]:
            raise CheckpointError(
                f"checkpoint {path!r} is damaged: {name} has {actual} bytes, the commit recorded {want['size']} "
                "(truncated or overwritten)"
            )
    for name, want in record["files"].items():
        crc = _crc32(os.path.join(root, name))
        if crc != want["crc32"]:
            raise CheckpointError(
                f"checkpoint {path!r} is damaged: {name} has CRC-32 {crc}, the commit recorded {want['crc32']} "
                "(bytes changed on disk after the save)"
            )


def committed_checkpoints(folder: str) -> list[tuple[float, str]]:
    """``(commit time, path)`` of the committed checkpoints directly inside ``folder``, oldest first."""
    out: list[tuple[float, str]] = []
    if not os.path.isdir(folder):
        return out
    for entry in os.listdir(folder):
        full = os.path.join(folder, entry)
        if entry.startswith(".") or not os.path.isfile(os.path.join(full, MARKER)):
            continue
        try:
            out.append((float(read_commit(full)["committed_at"]), full))
        except (CheckpointError, KeyError, TypeError, ValueError):
            continue
    return sorted(out)


def orphaned_copies(path: str) -> list[str]:
    """Committed copies of checkpoint ``path`` under its dot-names, oldest first: a re-save killed between its two
    renames leaves the new one in ``.<name>.tmp-*`` (its ``COMMIT.json`` already written) and the older one in
    ``.<name>.old-*`` while ``<name>`` itself is missing. The next save of ``<name>`` renames the newest back."""
    parent, base = os.path.dirname(os.path.abspath(path)), os.path.basename(os.path.abspath(path))
    if not os.path.isdir(parent):
        return []
    found = []
    for entry in os.listdir(parent):
        if entry.startswith((f".{base}.tmp-", f".{base}.old-")):
            try:
                found.append((float(read_commit(os.path.join(parent, entry))["committed_at"]), entry))
            except (CheckpointError, KeyError, TypeError, ValueError):
                continue
    return [os.path.join(parent, entry) for _, entry in sorted(found)]


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
    return found[-1][1] if found else None
