# SPDX-License-Identifier: Apache-2.0
"""Full-model save/load in the Hugging Face layout: one file (``model.safetensors`` / ``pytorch_model.bin``), or
size-capped shards ``<stem>-00001-of-0000N.<ext>`` plus ``<stem>.<ext>.index.json`` (``weight_map``: tensor name ->
shard file), as transformers writes and reads them.

Saving gathers the full state dict (FSDP2 DTensors included) with
``torch.distributed.checkpoint.state_dict.get_model_state_dict(full_state_dict=True, cpu_offload=True)``; every
rank must call it and rank 0 writes, through the one writer (a single file with its sidecar manifest, replaced
atomically; shards and their index into the directory the user names, which may already hold ``config.json`` and
tokenizer files). Loading checks the manifest when there is one (a Hugging Face download has none and is read as
it is), picks each file's reader from its bytes (safetensors header or ``torch.save`` archive, read with
``weights_only=True``), never from its name, and applies the files one at a time with
``set_model_state_dict(full_state_dict=True)``, which shards them again for FSDP2: a save loads at any world size
and into a plain ``nn.Module``.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stepforge.core import WrappedModel

from ._layout import MARKER, CheckpointMismatchError, read_commit, read_torch_file, verify_save
from ._pending import PendingWrites, staged, write_on_rank0
from ._writer import check_name, check_target, write_file, write_files

__all__ = [
    "INDEX_SUFFIX",
    "files_to_read",
    "is_safetensors",
    "load_model",
    "prefixed",
    "read_file",
    "save_model",
    "unwrap_model",
    "write_shards",
]

logger = logging.getLogger("stepforge.strategy")

SAFE_WEIGHTS = "model.safetensors"
BIN_WEIGHTS = "pytorch_model.bin"
INDEX_SUFFIX = ".index.json"


def prefixed(prefix: str | None, stem: str) -> str:
    """``stem`` after ``prefix``, joined with ``-`` (``"ema"`` -> ``"ema-model"``) unless it ends in ``-``/``_``."""
    if not prefix:
        return stem
    return f"{prefix}{stem}" if prefix.endswith(("-", "_")) else f"{prefix}-{stem}"


def weight_names(prefix: str | None, use_safetensors: bool) -> tuple[str, str]:
    """``(stem, extension)`` of the weight files: ``("model", "safetensors")``, ``("pytorch_model", "bin")``."""
    stem, ext = (SAFE_WEIGHTS if use_safetensors else BIN_WEIGHTS).rsplit(".", 1)
    return prefixed(prefix, stem), ext


def unshare(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors that own their whole storage (safetensors refuses tied weights and views into bigger storage): a
    tensor sharing storage with an earlier entry or covering part of its storage is copied, the rest are not."""
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
    # checked by the caller (verify_save): the file's manifest, or its directory's COMMIT.json
    return read_torch_file(path, where="load_model", verify=False)  # type: ignore[no-any-return]


def files_to_read(path: Path) -> list[Path]:
    """The weight files of a model save at ``path``: a directory (the entry its stepforge model save recorded, so
    a directory that also holds other weights is read as that save wrote it; else its one index or its one weight
    file), an index JSON, or a single file."""
    if path.is_dir():
        meta = read_commit(str(path))["meta"] if (path / MARKER).is_file() else {}
        entry = meta.get("entry") if meta.get("kind") == "model" else None
        if isinstance(entry, str) and entry:
            return files_to_read(path / entry)
        indexes = sorted(path.glob(f"*{INDEX_SUFFIX}"))
        if len(indexes) > 1:
            raise ValueError(f"load_model: {path} holds several index files {indexes}; pass one of them.")
        found = indexes or sorted(path.glob("*.safetensors")) or sorted(path.glob("*.bin"))
        if len(found) != 1:
            raise FileNotFoundError(
                f"load_model: {path} holds no index file and {len(found)} weight files; expected "
                f"{SAFE_WEIGHTS} (or {BIN_WEIGHTS}), or shards with an index JSON."
            )
        return files_to_read(found[0])
    if path.name.endswith(INDEX_SUFFIX):
        weight_map = json.loads(path.read_text())["weight_map"]
        return [path.parent / name for name in sorted(set(weight_map.values()))]
    if path.is_file():
        return [path]
    raise FileNotFoundError(f"load_model: no checkpoint at {path}.")


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
    """The full, unsharded CPU state dict of ``model`` on rank 0 (collective; FSDP2's other ranks get ``{}``)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(unwrap_model(model), options=options)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def _file_target(checkpoint: str | os.PathLike[str], prefix: str | None, use_safetensors: bool) -> Path:
    """The file an unsharded save writes: ``checkpoint`` itself, or the HF file name inside it when it is a folder."""
    path = Path(check_name(checkpoint, arg="checkpoint", where="save_model"))
    if path.is_dir():
        stem, ext = weight_names(prefix, use_safetensors)
        path = path / f"{stem}.{ext}"
    return path


def save_model(
    model: nn.Module,
    checkpoint: str | os.PathLike[str],
    *,
    shard: bool = False,
    prefix: str | None = None,
    size_per_shard: float = 1024,
    use_safetensors: bool = True,
    pending: PendingWrites | None = None,
) -> None:
    """Write ``model``'s full state in the HF layout (see the module docstring). Collective: every rank gathers,
    rank 0 writes, every rank gets the outcome (the same :class:`CheckpointError` on failure). ``pending``: the
    state is staged and the target checked now, the write runs on the background writer (safetensors, as
    ColossalAI's asynchronous saves)."""
    if not isinstance(size_per_shard, int | float) or size_per_shard <= 0:
        raise ValueError(f"save_model: size_per_shard must be > 0 (MiB), got {size_per_shard!r}.")
    state = gather_full_state_dict(model)
    if pending is not None:
        if not use_safetensors:
            logger.warning(
                "save_model: use_async=True writes safetensors (use_safetensors set to True), as ColossalAI."
            )
        use_safetensors, state = True, staged(state)
    target = checkpoint if shard else _file_target(checkpoint, prefix, use_safetensors)
    claim = partial(
        check_target, target, arg="checkpoint", where="save_model", kind="files" if shard else "file"
    )
    write = partial(
        write_full_state_dict, state, checkpoint, shard=shard, prefix=prefix, size_per_shard=size_per_shard,
        use_safetensors=use_safetensors,
    )  # fmt: skip
    write_on_rank0(write, where="save_model", pending=pending, claim=claim)


def write_full_state_dict(
    state: dict[str, torch.Tensor],
    checkpoint: str | os.PathLike[str],
    *,
    shard: bool,
    prefix: str | None,
    size_per_shard: float,
    use_safetensors: bool,
) -> str:
    """Write a full state dict (as :func:`gather_full_state_dict` returns it) through the one writer, by this
    process alone (rank 0, or its background writer)."""
    meta: dict[str, Any] = {"kind": "model", "format": "safetensors" if use_safetensors else "torch"}
    if not shard:
        return write_file(
            _file_target(checkpoint, prefix, use_safetensors),
            lambda tmp: write_tensors(unshare(state), tmp, use_safetensors),
            arg="checkpoint", where="save_model", meta=meta,
        )  # fmt: skip

    def write(tmp: str) -> list[str]:
        names = write_shards(state.items(), tmp, prefix, size_per_shard * 1024 * 1024, use_safetensors)
        meta["entry"] = names[-1]  # the file a reader starts from; the writer records meta after write()
        return names

    return write_files(
        checkpoint, write, arg="checkpoint", where="save_model", meta=meta,
        stale=stale_shards(prefix, use_safetensors),
    )  # fmt: skip


def _shapes(file: Path) -> dict[str, torch.Tensor]:
    """The tensors of one weight file as meta tensors (names, shapes, dtypes): a safetensors header is read
    alone; a ``torch.save`` file is read whole and dropped."""
    if is_safetensors(file):
        from safetensors import safe_open

        with safe_open(str(file), framework="pt") as f:
            return {k: _meta_like(f.get_slice(k)) for k in f.keys()}
    return {k: v.to("meta") for k, v in read_file(file).items() if isinstance(v, torch.Tensor)}


#: safetensors' dtype names (its header's ``dtype``)
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip


def _meta_like(view: Any) -> torch.Tensor:
    return torch.empty(view.get_shape(), dtype=_SAFETENSORS_DTYPES[view.get_dtype()], device="meta")


def load_model(model: nn.Module, checkpoint: str | os.PathLike[str], *, strict: bool = True) -> None:
    """Load a full HF-layout save into ``model`` (plain, DDP or FSDP2) at any world size, one weight file at a
    time (a sharded save streams in shard by shard: FSDP2 keeps this rank's part of each tensor). Collective."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    verify_save(os.fspath(checkpoint), where="load_model")  # checksums first: nothing damaged is read
    files = files_to_read(Path(checkpoint))
    module = unwrap_model(model)
    # verify every file's names, shapes and dtypes, then apply one file at a time: a file of another model raises
    # before any parameter is written, and a rank never holds more of the checkpoint than its largest file
    # (a dtype may differ: the load casts, as torch's load_state_dict; DTensors compare by their global shape)
    saved: dict[str, Any] = {}
    for file in files:
        saved.update(_shapes(file))
    live = get_model_state_dict(module)
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
        if tuple(have.shape) != tuple(want.shape):
            raise CheckpointMismatchError(
                f"load_model: {checkpoint} does not match the model: {key} is {have.dtype}{tuple(have.shape)} "
                f"there and {want.dtype}{tuple(want.shape)} here"
            )
    options = StateDictOptions(full_state_dict=True, strict=False)
    for file in files:
        state: dict[str, Any] = read_file(file)
        set_model_state_dict(module, state, options=options)
        del state
