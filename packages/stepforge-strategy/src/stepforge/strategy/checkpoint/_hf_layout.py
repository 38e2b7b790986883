# SPDX-License-Identifier: Apache-2.0
"""The Hugging Face layout of a full model: one file (``model.safetensors`` / ``pytorch_model.bin``), or
size-capped shards ``<stem>-00001-of-0000N.<ext>`` plus ``<stem>.<ext>.index.json`` (``weight_map``: tensor name ->
shard file), as transformers writes and reads them.

Writing here is into a folder the one writer hands over (its temporary directory); reading picks the reader from
each file's bytes (safetensors header or ``torch.save`` archive), never from its name, and ``torch.load`` runs with
``weights_only=True``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from ._layout import MARKER, read_commit, read_torch_file

__all__ = [
    "SAFE_WEIGHTS",
    "BIN_WEIGHTS",
    "INDEX_SUFFIX",
    "weight_names",
    "unshare",
    "write_tensors",
    "write_shards",
    "stale_shards",
    "is_safetensors",
    "read_file",
    "files_to_read",
]

SAFE_WEIGHTS = "model.safetensors"
BIN_WEIGHTS = "pytorch_model.bin"
INDEX_SUFFIX = ".index.json"


def weight_names(prefix: str | None, use_safetensors: bool) -> tuple[str, str]:
    """``(stem, extension)`` of the weight files: ``("model", "safetensors")``, ``("pytorch_model", "bin")``;
    a prefix joins with ``-`` (``"ema"`` -> ``"ema-model"``) unless it already ends in ``-`` or ``_``."""
    stem, ext = (SAFE_WEIGHTS if use_safetensors else BIN_WEIGHTS).rsplit(".", 1)
    if prefix:
        stem = f"{prefix}-{stem}" if not prefix.endswith(("-", "_")) else f"{prefix}{stem}"
    return stem, ext


def unshare(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors that own their whole storage: safetensors refuses tied weights and views into bigger storage.

    A tensor whose storage is shared with an earlier entry, or that covers only part of its storage, is
    copied; the rest are written as they are (no extra memory)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for key, tensor in state.items():
        tensor = tensor.detach()
        storage = tensor.untyped_storage()
        owns = tensor.is_contiguous() and tensor.numel() * tensor.element_size() == storage.nbytes()
        if storage.data_ptr() in seen or not owns:
            tensor = tensor.contiguous().clone()
        seen.add(tensor.untyped_storage().data_ptr())
        out[key] = tensor
    return out


def write_tensors(tensors: dict[str, torch.Tensor], path: str, use_safetensors: bool) -> None:
    """One weight file: safetensors (``metadata={"format": "pt"}``, as transformers) or ``torch.save``."""
    if use_safetensors:
        from safetensors.torch import save_file

        save_file(tensors, path, metadata={"format": "pt"})
    else:
        torch.save(tensors, path)


def write_shards(
    tensors: Iterable[tuple[str, torch.Tensor]],
    folder: str,
    prefix: str | None,
    cap_bytes: float,
    use_safetensors: bool,
) -> list[str]:
    """The sharded layout into ``folder``, split as transformers does (shards of at most ``cap_bytes``, a bigger
    tensor alone) holding one shard in memory at a time: one file when everything fits, else numbered shards plus
    the index JSON. Returns the file names in the order they may go live: shards first, the entry (index or the
    one file) last."""
    stem, ext = weight_names(prefix, use_safetensors)
    parts: list[list[str]] = []
    shard: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        write_tensors(unshare(shard), os.path.join(folder, f"part-{len(parts)}.tmp"), use_safetensors)
        parts.append(list(shard))
        shard.clear()

    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shard and size + nbytes > cap_bytes:
            flush()
            size = 0
        shard[name] = tensor
        size += nbytes
        total += nbytes
    flush()
    if len(parts) == 1:
        os.replace(os.path.join(folder, "part-0.tmp"), os.path.join(folder, f"{stem}.{ext}"))
        return [f"{stem}.{ext}"]
    weight_map: dict[str, str] = {}
    names = []
    for i, keys in enumerate(parts):
        names.append(f"{stem}-{i + 1:05d}-of-{len(parts):05d}.{ext}")
        os.replace(os.path.join(folder, f"part-{i}.tmp"), os.path.join(folder, names[-1]))
        weight_map.update(dict.fromkeys(keys, names[-1]))
    index = f"{stem}.{ext}{INDEX_SUFFIX}"
    with open(os.path.join(folder, index), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
    return [*names, index]


def stale_shards(prefix: str | None, use_safetensors: bool) -> Callable[[str], bool]:
    """Whether a file name is one of this layout's own (``<stem>-NNNNN-of-NNNNN.<ext>``, ``<stem>.<ext>`` or its
    index) for these weight names: what an earlier save of them left, which a new save that does not rewrite it
    may remove (transformers' ``save_pretrained`` removes such shards)."""
    stem, ext = weight_names(prefix, use_safetensors)
    pattern = re.compile(
        rf"{re.escape(stem)}(-\d{{5}}-of-\d{{5}})?\.{re.escape(ext)}({re.escape(INDEX_SUFFIX)})?"
    )
    return lambda name: pattern.fullmatch(name) is not None


_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's archive (torch >= 1.6)
_PICKLE_PROTO = 0x80  # pickle's PROTO opcode: a legacy (non-zip) torch.save
_SAFETENSORS_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit on its JSON header


def is_safetensors(path: Path) -> bool:
    """Whether ``path`` holds a safetensors file, from its bytes (``save_model`` may have written one under any
    name): an 8-byte little-endian header length that fits the file, then the JSON header's ``{``.

    Raises:
        ValueError: the file is neither safetensors nor a ``torch.save`` archive or pickle.
    """
    with open(path, "rb") as f:
        head = f.read(9)
    size = path.stat().st_size
    # the header first: its length's low byte may be 0x80 (a 640-byte header), pickle's PROTO opcode
    if len(head) == 9 and head[8:9] == b"{":
        length = int.from_bytes(head[:8], "little")
        if 0 < length <= min(size - 8, _SAFETENSORS_MAX_HEADER):
            return True
    if head[:4] == _ZIP_MAGIC or head[:1] == bytes([_PICKLE_PROTO]):
        return False
    raise ValueError(
        f"load_model: {path} is neither a safetensors file nor a torch.save archive (first bytes {head!r}); "
        "pass a file written by save_model or torch.save."
    )


def read_file(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of one weight file; the reader is chosen from the file's bytes, never its name."""
    if is_safetensors(path):
        from safetensors.torch import load_file

        return load_file(str(path))
    # checked by the caller (read_full_state_dict): the file's manifest, or its directory's COMMIT.json
    tensors: dict[str, torch.Tensor] = read_torch_file(path, where="load_model", verify=False)
    return tensors


def _files_of_index(index: Path) -> list[Path]:
    weight_map = json.loads(index.read_text())["weight_map"]
    return [index.parent / name for name in sorted(set(weight_map.values()))]


def _entry_of_commit(directory: Path) -> Path | None:
    """The file a stepforge model save into ``directory`` named as its entry (its index or single file), so a
    directory that also holds other weights (a user's, a Hugging Face download's) is read as that save wrote it."""
    if not (directory / MARKER).is_file():
        return None
    meta = read_commit(str(directory)).get("meta", {})
    entry = meta.get("entry") if isinstance(meta, dict) and meta.get("kind") == "model" else None
    return directory / entry if isinstance(entry, str) and entry else None


def _files_in(directory: Path) -> Iterable[Path]:
    entry = _entry_of_commit(directory)
    if entry is not None:
        return _files_of_index(entry) if entry.name.endswith(INDEX_SUFFIX) else [entry]
    indexes = sorted(directory.glob(f"*{INDEX_SUFFIX}"))
    if len(indexes) > 1:
        raise ValueError(f"load_model: {directory} holds several index files {indexes}; pass one of them.")
    if indexes:
        return _files_of_index(indexes[0])
    singles = sorted(directory.glob("*.safetensors")) or sorted(directory.glob("*.bin"))
    if len(singles) != 1:
        raise FileNotFoundError(
            f"load_model: {directory} holds no index file and {len(singles)} weight files; expected "
            f"{SAFE_WEIGHTS} (or {BIN_WEIGHTS}), or shards with an index JSON."
        )
    return singles


def files_to_read(path: Path) -> list[Path]:
    """The weight files of a model save at ``path``: a directory (its save's entry, else its one index or its one
    weight file), an index JSON, or a single file."""
    if path.is_dir():
        return list(_files_in(path))
    if path.name.endswith(INDEX_SUFFIX):
        return _files_of_index(path)
    if path.is_file():
        return [path]
    raise FileNotFoundError(f"load_model: no checkpoint at {path}.")
