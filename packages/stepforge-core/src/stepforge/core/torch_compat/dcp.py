# SPDX-License-Identifier: Apache-2.0
"""torch.distributed.checkpoint (DCP) internals: its key flattening (``_nested_dict.flatten_state_dict``),
a reader and planner that run no code from a checkpoint, and an instance ``state_dict`` that DCP's state-dict
helpers step around (``state_dict._patched_state_dict``).

torch's ``FileSystemReader`` unpickles ``.metadata`` with plain ``pickle.load`` and its ``DefaultLoadPlanner``
reads non-tensor entries with ``torch.load(weights_only=False)``: a checkpoint could run code. The safe
versions need DCP's metadata classes (``filesystem._StorageInfo``, ``metadata._MEM_FORMAT_ENCODING``) and
``_traverse.set_element``.
"""

from __future__ import annotations

import collections
import io
import pathlib
import pickle
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

from .private_apis import resolve

__all__ = ["SafeFileSystemReader", "SafeLoadPlanner", "flatten_state_dict", "set_instance_state_dict"]


def flatten_state_dict(state_dict: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """DCP's flat view of a nested state dict: ``{"a": {"b": t}}`` -> ``({"a.b": t}, {"a.b": ("a", "b")})``.

    These are the keys DCP writes into its metadata for the same nested dict.
    """
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict as flatten

    return flatten(dict(state_dict))


def set_instance_state_dict(module: nn.Module, state_dict: Callable[..., Any]) -> None:
    """Make ``state_dict`` the ``state_dict`` of this ``module`` instance while torch's DCP helpers
    (``get_model_state_dict``, ``get_state_dict``, ...) keep calling the class's ``state_dict`` on it.

    DCP's helpers call ``module.state_dict()`` and use the class's method instead only for callables in its
    ``_patched_state_dict`` set (its own ``_patch_model_state_dict`` registers there). ``state_dict`` is added to
    that set for as long as ``module`` lives; it must not hold ``module`` strongly (use a weak reference), or the
    set keeps the module alive.
    """
    from torch.distributed.checkpoint import state_dict as dcp_state_dict

    patched: set[Callable[..., Any]] = dcp_state_dict._patched_state_dict
    module.state_dict = state_dict  # type: ignore[method-assign]
    patched.add(state_dict)
    weakref.finalize(module, patched.discard, state_dict)


def _dcp_metadata_globals() -> dict[tuple[str, str], Any]:
    """The globals a DCP ``.metadata`` pickle may name: DCP's metadata classes, torch dtypes and containers."""
    from torch.distributed.checkpoint import filesystem, metadata

    classes: list[Any] = [
        metadata.Metadata,
        metadata.TensorStorageMetadata,
        metadata.BytesStorageMetadata,
        metadata.ChunkStorageMetadata,
        metadata.TensorProperties,
        metadata.StorageMeta,
        metadata.MetadataIndex,
        metadata._MEM_FORMAT_ENCODING,
        filesystem._StorageInfo,
        torch.Size,
        collections.OrderedDict,
        pathlib.PosixPath,
        pathlib.WindowsPath,
    ]
    allowed = {(c.__module__, c.__qualname__): c for c in classes}
    # layouts pickle as ``_get_layout("torch.strided")``, a lookup in torch's table of layouts
    allowed[("torch.serialization", "_get_layout")] = resolve("torch.serialization", "_get_layout")
    for name in dir(torch):  # dtypes, layouts and memory formats pickle as ``torch.<name>``
        value = getattr(torch, name, None)
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            allowed[("torch", name)] = value
    return allowed


class _DcpMetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, allowed: dict[tuple[str, str], Any]) -> None:
        super().__init__(file)
        self._allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        found = self._allowed.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(
                f"DCP metadata names {module}.{name}, which is not a DCP metadata class, torch dtype or plain "
                "container; refusing to unpickle it (it could run code)"
            )
        return found


class SafeFileSystemReader(FileSystemReader):
    """``torch.distributed.checkpoint.FileSystemReader`` whose ``read_metadata`` runs no code from the file.

    ``.metadata`` is unpickled with an unpickler that resolves only DCP's metadata classes, torch dtypes/layouts/
    memory formats, ``torch.Size``, ``OrderedDict`` and paths; any other global raises
    :class:`pickle.UnpicklingError` before it is called.
    """

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

        rank = kwargs.get("rank")
        path = self._get_metadata_path(rank)
        with self.fs.create_stream(path, "rb") as stream:
            data = stream.read()
        metadata = _DcpMetadataUnpickler(io.BytesIO(data), _dcp_metadata_globals()).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"DCP metadata holds a {type(metadata).__name__}, not a Metadata")
        storage_meta = metadata.storage_meta if metadata.storage_meta is not None else StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that reads non-tensor entries with ``torch.load(weights_only=True)``.

    torch's planner unpickles them with ``weights_only=False``; here an entry naming anything but tensors and
    plain containers raises :class:`pickle.UnpicklingError`.
    """

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
