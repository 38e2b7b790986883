# SPDX-License-Identifier: Apache-2.0
"""Full-model save/load in the Hugging Face layout (``model.safetensors`` or size-capped shards + index).

Saving gathers the full state dict (FSDP2 DTensors included) with
``torch.distributed.checkpoint.state_dict.get_model_state_dict(full_state_dict=True, cpu_offload=True)``; every
rank must call it and rank 0 writes. Loading reads the file(s) on every rank and applies them with
``set_model_state_dict(full_state_dict=True)``, one file at a time (never the whole model at once), which shards
them again for FSDP2, so a save loads at any world size and into a plain ``nn.Module`` (``safetensors.torch.load_file``).

Every save goes through the one checkpoint writer: a single file via ``commit_file`` (an existing file at that path
is replaced atomically; sidecar manifest ``<file>.stepforge.json``), shards and their index via ``commit_files``
(into the directory the user names, which may already hold ``config.json`` and tokenizer files; ``COMMIT.json``
lists this save's files and names its entry). The layout itself is ``_hf_layout.py``. Loads check the manifest
when there is one (a Hugging Face download has none and is read as it is).
"""

from __future__ import annotations

import logging
import os
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stepforge.core import WrappedModel

from ._hf_layout import (
    INDEX_SUFFIX,
    files_to_read,
    is_safetensors,
    read_file,
    stale_shards,
    unshare,
    weight_names,
    write_shards,
    write_tensors,
)
from ._layout import CheckpointMismatchError, verify_dir, verify_file
from ._pending import PendingWrites, staged, write_on_rank0
from ._writer import check_name, check_target, on_rank0, write_file, write_files

__all__ = ["save_model", "load_model", "unwrap_model"]

logger = logging.getLogger("stepforge.strategy")


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
        # the name is checked now, on every rank: a refused one raises here, not at the wait
        if shard:
            check = partial(check_target, checkpoint, arg="checkpoint", where="save_model", kind="files")
        else:
            target = _file_target(checkpoint, prefix, use_safetensors)
            check = partial(check_target, target, arg="checkpoint", where="save_model", kind="file")
        on_rank0(check, where="save_model")
    write = partial(
        write_full_state_dict, state, checkpoint, shard=shard, prefix=prefix, size_per_shard=size_per_shard,
        use_safetensors=use_safetensors,
    )  # fmt: skip
    write_on_rank0(write, where="save_model", pending=pending)


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


def _verify(path: Path) -> None:
    """Checksums first (COMMIT.json of a sharded save, the sidecar manifest of a single file): nothing damaged is
    read; a directory or file stepforge did not write (no manifest) is read as it is."""
    if path.is_dir():
        verify_dir(str(path), required=False, where="load_model")
    elif path.name.endswith(INDEX_SUFFIX):
        verify_dir(str(path.parent), required=False, where="load_model")
    elif path.is_file():
        verify_file(str(path))


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


def check_full_state_dict(
    checkpoint: str | os.PathLike[str], saved: dict[str, Any], live: dict[str, Any], *, strict: bool
) -> None:
    """``saved`` (read from ``checkpoint``) fits ``live`` (the model's state dict; DTensors by their global
    shape): the same keys when ``strict``, and every common key with the same shape. A dtype may differ: the
    load casts, as torch's ``load_state_dict`` (an fp16 save loads into an fp32 or bf16 model and back).

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
        if tuple(have.shape) != tuple(want.shape):
            raise CheckpointMismatchError(
                f"load_model: {checkpoint} does not match the model: {key} is {have.dtype}{tuple(have.shape)} "
                f"there and {want.dtype}{tuple(want.shape)} here"
            )


def load_model(model: nn.Module, checkpoint: str | os.PathLike[str], *, strict: bool = True) -> None:
    """Load a full HF-layout save into ``model`` (plain, DDP or FSDP2) at any world size, one weight file at a
    time (a sharded save streams in shard by shard: FSDP2 keeps this rank's part of each tensor). Collective."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    path = Path(checkpoint)
    _verify(path)
    files = files_to_read(path)
    module = unwrap_model(model)
    # verify every file's names, shapes and dtypes, then apply one file at a time: a file of another model raises
    # before any parameter is written, and a rank never holds more of the checkpoint than its largest file
    headers: dict[str, Any] = {}
    for file in files:
        headers.update(_shapes(file))
    check_full_state_dict(checkpoint, headers, get_model_state_dict(module), strict=strict)
    options = StateDictOptions(full_state_dict=True, strict=False)
    for file in files:
        state: dict[str, Any] = read_file(file)
        set_model_state_dict(module, state, options=options)
        del state
