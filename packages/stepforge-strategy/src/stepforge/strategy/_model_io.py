# SPDX-License-Identifier: Apache-2.0
"""Full-model save/load in the Hugging Face layout (``model.safetensors`` or size-capped shards + index).

Saving gathers the full state dict (FSDP2 DTensors included) with
``torch.distributed.checkpoint.state_dict.get_model_state_dict(full_state_dict=True, cpu_offload=True)``; every
rank must call it and rank 0 writes. Loading reads the file(s) on every rank and applies them with
``set_model_state_dict(full_state_dict=True)``, which shards them again for FSDP2, so a save loads at any
world size and into a plain ``nn.Module`` (``safetensors.torch.load_file``).

Every save goes through the one checkpoint writer: a single file via ``checkpoint.commit_file`` (atomic, sidecar
manifest ``<file>.stepforge.json``), shards via ``checkpoint.commit_dir`` (``COMMIT.json``); loads check the
manifest when there is one (a Hugging Face download has none and is read as it is).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from stepforge.core import WrappedModel

from .checkpoint import (
    CheckpointError,
    CheckpointMismatchError,
    check_name,
    check_target,
    commit_dir,
    commit_dir_here,
    commit_file,
    verify_dir,
    verify_file,
    write_with_sidecar,
)

__all__ = [
    "save_model",
    "write_full_state_dict",
    "load_model",
    "gather_full_state_dict",
    "unwrap_model",
    "SAFE_WEIGHTS",
    "BIN_WEIGHTS",
    "is_safetensors",
    "check_full_state_dict",
]

SAFE_WEIGHTS = "model.safetensors"
BIN_WEIGHTS = "pytorch_model.bin"
_INDEX_SUFFIX = ".index.json"


def _is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _is_dist() else 0


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module under a plugin's model wrapper (a :class:`stepforge.core.WrappedModel`, as ColossalAI's
    ``ModelWrapper`` and stepforge-zero's ``LowLevelZeroModel``); DDP and FSDP2 modules are returned as they are
    (torch's state-dict functions handle them)."""
    for _ in range(8):
        if not isinstance(model, WrappedModel):
            return model
        inner = model.unwrap()
        if not isinstance(inner, nn.Module) or inner is model:
            return model
        model = inner
    return model


def gather_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full, unsharded CPU state dict of ``model`` on rank 0 (other ranks get an empty dict for FSDP2).

    Collective: every rank must call it.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(unwrap_model(model), options=options)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def _file_names(prefix: str | None, use_safetensors: bool) -> tuple[str, str]:
    base = SAFE_WEIGHTS if use_safetensors else BIN_WEIGHTS
    stem, ext = base.rsplit(".", 1)
    if prefix:
        stem = f"{prefix}-{stem}" if not prefix.endswith(("-", "_")) else f"{prefix}{stem}"
    return stem, ext


def _unshare(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
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


def _write(tensors: dict[str, torch.Tensor], path: str, use_safetensors: bool) -> None:
    if use_safetensors:
        from safetensors.torch import save_file

        save_file(tensors, path, metadata={"format": "pt"})
    else:
        torch.save(tensors, path)


def _shards(state: dict[str, torch.Tensor], cap_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > cap_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += nbytes
    return shards


def save_model(
    model: nn.Module,
    checkpoint: str | os.PathLike[str],
    *,
    shard: bool = False,
    prefix: str | None = None,
    size_per_shard: int = 1024,
    use_safetensors: bool = True,
) -> None:
    """Write ``model``'s full state in the HF layout (see the module docstring). Collective."""
    if not isinstance(size_per_shard, int | float) or size_per_shard <= 0:
        raise ValueError(f"save_model: size_per_shard must be > 0 (MiB), got {size_per_shard!r}.")
    state = gather_full_state_dict(model)
    fmt = "safetensors" if use_safetensors else "torch"
    if not shard:
        commit_file(
            _file_target(checkpoint, prefix, use_safetensors), lambda tmp: _write(_unshare(state), tmp, use_safetensors),
            arg="checkpoint", where="save_model", meta={"kind": "model", "format": fmt},
        )  # fmt: skip
        return

    def write_dir(tmp: str) -> None:
        if _rank() == 0:
            _write_shards(_unshare(state), tmp, prefix, size_per_shard, use_safetensors)

    commit_dir(
        checkpoint, write_dir, meta={"kind": "model", "format": fmt}, arg="checkpoint", where="save_model"
    )


def write_full_state_dict(
    state: dict[str, torch.Tensor],
    checkpoint: str | os.PathLike[str],
    *,
    shard: bool = False,
    prefix: str | None = None,
    size_per_shard: int = 1024,
    use_safetensors: bool = True,
) -> None:
    """Write a full state dict (as :func:`gather_full_state_dict` returns it) like :func:`save_model` does, through
    the same commit (checksummed, atomic), by this process alone: not collective, so an asynchronous save runs it
    on rank 0's writer thread. Raises :class:`CheckpointError` on failure (nothing committed)."""
    state = _unshare(state)
    meta = {"kind": "model", "format": "safetensors" if use_safetensors else "torch"}
    if not shard:
        target = check_target(
            _file_target(checkpoint, prefix, use_safetensors),
            arg="checkpoint",
            where="save_model",
            kind="file",
        )
        write_with_sidecar(target, lambda tmp: _write(state, tmp, use_safetensors), "save_model", meta)
        return
    commit_dir_here(
        checkpoint, lambda tmp: _write_shards(state, tmp, prefix, size_per_shard, use_safetensors),
        meta=meta, arg="checkpoint", where="save_model",
    )  # fmt: skip


def _file_target(checkpoint: str | os.PathLike[str], prefix: str | None, use_safetensors: bool) -> Path:
    """The file an unsharded save writes: ``checkpoint`` itself, or the HF file name inside it when it is a folder."""
    path = Path(check_name(checkpoint, arg="checkpoint", where="save_model"))
    if path.is_dir():
        stem, ext = _file_names(prefix, use_safetensors)
        path = path / f"{stem}.{ext}"
    return path


def _write_shards(
    state: dict[str, torch.Tensor],
    folder: str,
    prefix: str | None,
    size_per_shard: float,
    use_safetensors: bool,
) -> None:
    """The HF sharded layout into ``folder``: one file, or numbered shards plus the index JSON."""
    stem, ext = _file_names(prefix, use_safetensors)
    shards = _shards(state, int(size_per_shard * 1024 * 1024))
    if len(shards) == 1:
        _write(shards[0], os.path.join(folder, f"{stem}.{ext}"), use_safetensors)
        return
    weight_map: dict[str, str] = {}
    total = 0
    for i, part in enumerate(shards, 1):
        name = f"{stem}-{i:05d}-of-{len(shards):05d}.{ext}"
        _write(part, os.path.join(folder, name), use_safetensors)
        for key, tensor in part.items():
            weight_map[key] = name
            total += tensor.numel() * tensor.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with open(os.path.join(folder, f"{stem}.{ext}{_INDEX_SUFFIX}"), "w", encoding="utf-8") as f:
        f.write(json.dumps(index, indent=2, sort_keys=True))


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
    if head[:4] == _ZIP_MAGIC or head[:1] == bytes([_PICKLE_PROTO]):
        return False  # neither can start a safetensors file: its header length would exceed the limit
    if len(head) == 9 and head[8:9] == b"{":
        length = int.from_bytes(head[:8], "little")
        if 0 < length <= min(size - 8, _SAFETENSORS_MAX_HEADER):
            return True
    raise ValueError(
        f"load_model: {path} is neither a safetensors file nor a torch.save archive (first bytes {head!r}); "
        "pass a file written by save_model or torch.save."
    )


def _read_file(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of one weight file; the reader is chosen from the file's bytes, never its name."""
    if is_safetensors(path):
        from safetensors.torch import load_file

        return load_file(str(path))
    try:  # weights_only: no code runs from the file
        # a file object: torch.load would pick safetensors by a ".safetensors" name
        with open(path, "rb") as f:
            tensors: dict[str, torch.Tensor] = torch.load(f, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as exc:
        raise CheckpointError(f"load_model: {path} is unreadable or refused ({exc})") from exc
    return tensors


def _files_in(directory: Path) -> Iterable[Path]:
    indexes = sorted(directory.glob(f"*{_INDEX_SUFFIX}"))
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


def _files_of_index(index: Path) -> list[Path]:
    weight_map = json.loads(index.read_text())["weight_map"]
    return [index.parent / name for name in sorted(set(weight_map.values()))]


def read_full_state_dict(checkpoint: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of a file, an index JSON or a directory written by :func:`save_model`."""
    path = Path(checkpoint)
    # checksums first (COMMIT.json of a sharded save, the sidecar manifest of a single file): nothing damaged
    # is read; a directory or file stepforge did not write (no manifest) is read as it is
    if path.is_dir():
        verify_dir(str(path), required=False, where="load_model")
        files = list(_files_in(path))
    elif path.name.endswith(_INDEX_SUFFIX):
        verify_dir(str(path.parent), required=False, where="load_model")
        files = _files_of_index(path)
    elif path.is_file():
        verify_file(str(path))
        files = [path]
    else:
        raise FileNotFoundError(f"load_model: no checkpoint at {path}.")
    state: dict[str, Any] = {}
    for file in files:
        state.update(_read_file(file))
    return state


def check_full_state_dict(
    checkpoint: str | os.PathLike[str], saved: dict[str, Any], live: dict[str, Any], *, strict: bool
) -> None:
    """``saved`` (read from ``checkpoint``) fits ``live`` (the model's state dict; DTensors by their global
    shape): the same keys when ``strict``, and every common key with the same shape and dtype.

    Raises:
        CheckpointMismatchError: naming the file and the first differences; nothing has been loaded.
    """
    missing = sorted(set(live) - set(saved))
    unexpected = sorted(set(saved) - set(live))
    if strict and (missing or unexpected):
        raise CheckpointMismatchError(
            f"load_model: {checkpoint} does not match the model: missing keys {missing[:5]}, unexpected keys "
            f"{unexpected[:5]} (strict=True)"
        )
    for key in sorted(set(saved) & set(live)):
        have, want = saved[key], live[key]
        if not (isinstance(have, torch.Tensor) and isinstance(want, torch.Tensor)):
            continue
        if tuple(have.shape) != tuple(want.shape) or have.dtype != want.dtype:
            raise CheckpointMismatchError(
                f"load_model: {checkpoint} does not match the model: {key} is {have.dtype}{tuple(have.shape)} "
                f"there and {want.dtype}{tuple(want.shape)} here"
            )


def load_model(model: nn.Module, checkpoint: str | os.PathLike[str], *, strict: bool = True) -> None:
    """Load a full HF-layout save into ``model`` (plain, DDP or FSDP2) at any world size. Collective."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    state: dict[str, Any] = read_full_state_dict(checkpoint)
    module = unwrap_model(model)
    # verify, then apply: a file of another model raises before any parameter is written
    check_full_state_dict(checkpoint, state, get_model_state_dict(module), strict=strict)
    options = StateDictOptions(full_state_dict=True, strict=strict)
    result = set_model_state_dict(module, state, options=options)
    if strict and result is not None and (result.missing_keys or result.unexpected_keys):
        raise RuntimeError(
            f"load_model: missing keys {result.missing_keys}, unexpected keys {result.unexpected_keys}."
        )
