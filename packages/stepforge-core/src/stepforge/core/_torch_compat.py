# SPDX-License-Identifier: Apache-2.0
"""The one module of stepforge that uses torch private APIs; every package reaches them through here.

Each wrapper names the private it needs in :data:`PRIVATE_APIS`; ``tests/test_torch_compat.py`` resolves every
entry and exercises every wrapper on real torch objects, so a torch update that renames or removes one fails
there, naming the private and the torch version, instead of deep inside a training step. Where torch has a
public spelling it is used (``isinstance(t, DTensor)``, ``torch.distributed.fsdp.FSDPModule``,
``set_requires_gradient_sync``, ``DistributedDataParallel.no_sync``); the private is used only where torch
offers none:

- DTensor's local shard (``DTensor._local_tensor``): the public ``to_local()`` is an autograd function that
  returns a new view on every call: identity-keyed caches (fused buckets) and in-place steps need the shard
  itself, without an autograd node per tensor per step.
- FSDP2's pending unsharded gradients (``FSDPModule._get_fsdp_state()._fsdp_param_group.fsdp_params``,
  ``FSDPParam._unsharded_param``, ``FSDPParam._orig_size``): no public API exposes the gradients kept by
  ``set_requires_gradient_sync(False)``; checkpoints inside an accumulation window need them.
- DCP's ``flatten_state_dict`` (``torch.distributed.checkpoint._nested_dict``): the key layout DCP writes.
- DCP's metadata classes ``filesystem._StorageInfo`` and ``metadata._MEM_FORMAT_ENCODING`` and
  ``_traverse.set_element``: :class:`SafeFileSystemReader` unpickles ``.metadata`` allowing only DCP's own
  classes, and :class:`SafeLoadPlanner` reads DCP's non-tensor entries with ``weights_only=True`` (torch's
  reader uses plain ``pickle.load`` and ``torch.load(weights_only=False)``: a checkpoint could run code).
- ``nn.modules.batchnorm._NormBase``: the common base of BatchNorm/SyncBatchNorm/InstanceNorm and their lazy
  versions (modules whose running statistics are updated in the forward).
- ``Tensor._base``: the tensor a view was taken from (flat-buffer views of fused buckets).
- ``distributed_c10d._get_default_store``: the default group's key-value store (arrival barriers with a
  timeout, which ``barrier()`` does not offer on gloo).
- ``Variable._execution_engine.queue_callback``: run a function when the current backward pass ends.
- ``torch.distributed._composable.fsdp``: where FSDP2's ``FSDPModule`` lived before torch 2.6.
- ``torch.optim.lr_scheduler._LRScheduler``: the pre-2.0 scheduler base that ColossalAI's schedulers subclass and
  its trainers check with ``isinstance``; a wrapper that must pass those checks subclasses it.

Gradient synchronisation: :func:`gradient_sync_off` is the ``no_sync`` adapter for torch DDP
(``model.no_sync()``) and FSDP2 (``set_requires_gradient_sync(False)`` on every FSDP module of the target),
used by :func:`stepforge.core.no_sync` and by the FSDP2 plugins: the one place FSDP2's switch is written.
"""

from __future__ import annotations

import collections
import importlib
import io
import pathlib
import pickle
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

from .errors import StepforgeError

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = [
    "PRIVATE_APIS",
    "LegacyLRScheduler",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "TorchInternalsError",
    "ddp_no_sync",
    "default_store",
    "dtensor_local",
    "flatten_state_dict",
    "fsdp2_module_type",
    "fsdp2_modules",
    "fsdp2_no_sync",
    "fsdp2_params",
    "fsdp2_param_shape",
    "fsdp2_pending_grad",
    "gradient_sync_off",
    "is_ddp",
    "is_dtensor",
    "is_norm_with_running_stats",
    "queue_backward_callback",
    "set_fsdp2_pending_grad",
    "supports_gradient_sync_off",
    "view_base",
]


class TorchInternalsError(StepforgeError, RuntimeError):
    """A torch private API stepforge relies on is missing or changed in the installed torch version."""


def _changed(private: str, error: BaseException | None = None) -> TorchInternalsError:
    return TorchInternalsError(
        f"torch {torch.__version__} changed the private API {private!r} that stepforge.core._torch_compat wraps "
        f"({type(error).__name__}: {error}); update stepforge.core._torch_compat for this torch version, or "
        "install a torch version stepforge-core supports (see constraints/cpu.txt)."
    )


# -- DTensor ------------------------------------------------------------------------------------------------
_DTENSOR_TYPE: type | None = None
_PLAIN_TENSOR = torch.Tensor
_PARAMETER = nn.Parameter


def _dtensor_type() -> type | None:
    # No DTensor exists before torch.distributed.tensor is imported: look it up only once it is, so that
    # optimizers never pay for importing torch.distributed.tensor themselves.
    global _DTENSOR_TYPE
    if _DTENSOR_TYPE is None:
        module = sys.modules.get("torch.distributed.tensor")
        _DTENSOR_TYPE = None if module is None else vars(module).get("DTensor")
    return _DTENSOR_TYPE


def is_dtensor(t: Any) -> TypeGuard[DTensor]:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (an FSDP2 parameter or gradient)."""
    cls = type(t)
    if cls is _PLAIN_TENSOR or cls is _PARAMETER:  # the common case first: optimizers ask per tensor per step
        return False
    dtensor = _DTENSOR_TYPE if _DTENSOR_TYPE is not None else _dtensor_type()
    return dtensor is not None and isinstance(t, dtensor)


def dtensor_local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor as the tensor itself (same object every call, same storage), else ``t``.

    Unlike ``DTensor.to_local()`` this creates no view and no autograd node: in-place updates of the result
    update the DTensor.
    """
    cls = type(t)
    if cls is _PLAIN_TENSOR or cls is _PARAMETER or not is_dtensor(t):
        return t
    try:
        return t._local_tensor
    except AttributeError as error:  # pragma: no cover - only on a torch that changed DTensor
        raise _changed("DTensor._local_tensor", error) from error


# -- tensors and modules -------------------------------------------------------------------------------------
def view_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``t`` is a view of (``None`` when ``t`` is not a view)."""
    return t._base


def is_norm_with_running_stats(module: Any) -> bool:
    """Whether ``module`` is a BatchNorm, SyncBatchNorm or InstanceNorm layer (lazy ones included): a layer
    whose forward may update running statistics."""
    return isinstance(module, nn.modules.batchnorm._NormBase)


#: ``torch.optim.lr_scheduler._LRScheduler`` (a subclass of the public ``LRScheduler``), or ``LRScheduler`` on a
#: torch without the old name. Subclass it to pass ``isinstance(x, _LRScheduler)`` checks of ColossalAI code.
try:
    from torch.optim.lr_scheduler import _LRScheduler as LegacyLRScheduler
except ImportError:  # pragma: no cover - a torch that dropped the old name: LRScheduler is what remains
    from torch.optim.lr_scheduler import LRScheduler as LegacyLRScheduler  # type: ignore[assignment]


# -- autograd and the default store --------------------------------------------------------------------------
def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the backward pass now running ends (call it from inside a backward hook)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def default_store() -> Any:
    """The key-value store (``torch.distributed.Store``) of the default process group."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


# -- DCP -----------------------------------------------------------------------------------------------------
def flatten_state_dict(state_dict: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """DCP's flat view of a nested state dict: ``{"a": {"b": t}}`` -> ``({"a.b": t}, {"a.b": ("a", "b")})``.

    These are the keys DCP writes into its metadata for the same nested dict.
    """
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict as flatten

    return flatten(dict(state_dict))


_DCP = "torch.distributed.checkpoint."
_DCP_PRIVATES = (
    ("_traverse", "set_element"),
    ("filesystem", "_StorageInfo"),
    ("metadata", "_MEM_FORMAT_ENCODING"),
)


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
    allowed[("torch", "Size")] = torch.Size
    # layouts pickle as ``_get_layout("torch.strided")``, a lookup in torch's table of layouts
    allowed[("torch.serialization", "_get_layout")] = _resolve("torch.serialization", "_get_layout")
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


# -- FSDP2 ---------------------------------------------------------------------------------------------------
def fsdp2_module_type() -> type | None:
    """``FSDPModule`` (the class ``fully_shard`` mixes into a module), or ``None`` without FSDP2."""
    try:  # torch >= 2.6 exports it here
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - older torch
        try:
            from torch.distributed._composable.fsdp import FSDPModule
        except ImportError:
            return None
    return FSDPModule


def fsdp2_modules(target: Any) -> list[nn.Module]:
    """Every FSDP2 module in ``target`` (itself included), outermost first; ``[]`` for anything else."""
    fsdp_module = fsdp2_module_type()
    if fsdp_module is None or not isinstance(target, nn.Module):
        return []
    return [m for m in target.modules() if isinstance(m, fsdp_module)]


def fsdp2_params(model: nn.Module) -> Iterator[Any]:
    """Every ``FSDPParam`` (FSDP2's record of one sharded parameter) of every FSDP2 module of ``model``."""
    for module in fsdp2_modules(model):
        fsdp: Any = module  # an FSDPModule: its methods are not on nn.Module
        try:
            group = fsdp._get_fsdp_state()._fsdp_param_group
        except AttributeError as error:  # pragma: no cover - only on a torch that changed FSDP2
            raise _changed("FSDPModule._get_fsdp_state()._fsdp_param_group", error) from error
        if group is not None:
            yield from group.fsdp_params


def fsdp2_param_shape(fsdp_param: Any) -> torch.Size:
    """The unsharded shape of an ``FSDPParam``."""
    try:
        size: torch.Size = fsdp_param._orig_size
        return size
    except AttributeError as error:  # pragma: no cover - only on a torch that changed FSDP2
        raise _changed("FSDPParam._orig_size", error) from error


def fsdp2_pending_grad(fsdp_param: Any) -> torch.Tensor | None:
    """The unsharded gradient FSDP2 holds for ``fsdp_param`` inside a no-sync window (not reduce-scattered yet).

    ``FSDPParam.unsharded_accumulated_grad`` when a ``reduce_dtype`` differs from the parameter dtype, else the
    unsharded parameter's ``.grad``; ``None`` when there is none (the unsharded parameter may not exist yet).
    """
    grad: torch.Tensor | None = fsdp_param.unsharded_accumulated_grad
    if grad is None and hasattr(fsdp_param, "_unsharded_param"):
        grad = fsdp_param._unsharded_param.grad
    return grad


def set_fsdp2_pending_grad(fsdp_param: Any, grad: torch.Tensor | None) -> None:
    """Hand ``grad`` (unsharded, any device) to FSDP2 as the gradient accumulated so far for ``fsdp_param``: the
    next backward adds into it and the first synchronised one reduce-scatters the sum."""
    fsdp_param.unsharded_accumulated_grad = None if grad is None else grad.to(fsdp_param.device)


# -- no_sync adapters ----------------------------------------------------------------------------------------
def is_ddp(target: Any) -> bool:
    """Whether ``target`` is a torch ``DistributedDataParallel`` module."""
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(target, DistributedDataParallel)


def ddp_no_sync(target: Any) -> AbstractContextManager[Any]:
    """DDP's ``no_sync()``: the forward *and* the backward of non-final micro-batches must run inside."""
    context: AbstractContextManager[Any] = target.no_sync()
    return context


@contextmanager
def fsdp2_no_sync(target: Any) -> Iterator[None]:
    """``set_requires_gradient_sync(False)`` on every FSDP2 module of ``target`` for the block, ``True`` after.

    ``target`` may be an FSDP2 module or any module that *contains* some (sharding only the blocks is common).
    The flag is read in the backward, so wrapping the backward alone is enough; unsharded gradients are kept
    until the first synchronised backward reduce-scatters them.
    """
    modules: list[Any] = fsdp2_modules(target)  # FSDPModules: set_requires_gradient_sync is not on nn.Module
    for module in modules:
        # recurse=False on each module found: a plain root holding several sharded blocks has no single FSDP
        # module to recurse from, and the flag lives per module.
        module.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for module in modules:
            module.set_requires_gradient_sync(True, recurse=False)


def supports_gradient_sync_off(target: Any) -> bool:
    """Whether :func:`gradient_sync_off` has something to suspend for ``target`` (DDP, or FSDP2 inside)."""
    return is_ddp(target) or bool(fsdp2_modules(target))


def gradient_sync_off(target: Any) -> AbstractContextManager[Any] | None:
    """The torch ``no_sync`` adapter: DDP's ``no_sync()``, FSDP2's switch (:func:`fsdp2_no_sync`), else ``None``."""
    if is_ddp(target):
        return ddp_no_sync(target)
    if fsdp2_modules(target):
        return fsdp2_no_sync(target)
    return None


def _resolve(module: str, name: str) -> Any:
    return getattr(importlib.import_module(module), name)


#: Every torch private this module uses, as ``(dotted name, resolver)``; a resolver raises when the installed
#: torch no longer has the private. Instance attributes (``DTensor._local_tensor``, ``FSDPParam._orig_size``...)
#: are checked on live objects by the tests.
PRIVATE_APIS: tuple[tuple[str, Callable[[], Any]], ...] = (
    (
        "torch.distributed.checkpoint._nested_dict.flatten_state_dict",
        lambda: _resolve("torch.distributed.checkpoint._nested_dict", "flatten_state_dict"),
    ),
    *(
        (f"torch.distributed.checkpoint.{module}.{name}", lambda m=module, n=name: _resolve(_DCP + m, n))
        for module, name in _DCP_PRIVATES
    ),
    ("torch.serialization._get_layout", lambda: _resolve("torch.serialization", "_get_layout")),
    ("FileSystemReader._get_metadata_path", lambda: FileSystemReader._get_metadata_path),
    ("torch.optim.lr_scheduler._LRScheduler", lambda: _resolve("torch.optim.lr_scheduler", "_LRScheduler")),
    ("torch.nn.modules.batchnorm._NormBase", lambda: _resolve("torch.nn.modules.batchnorm", "_NormBase")),
    ("torch.Tensor._base", lambda: torch.Tensor._base),
    (
        "torch.distributed.distributed_c10d._get_default_store",
        lambda: _resolve("torch.distributed.distributed_c10d", "_get_default_store"),
    ),
    (
        "torch.autograd.Variable._execution_engine.queue_callback",
        lambda: torch.autograd.Variable._execution_engine.queue_callback,
    ),
    ("FSDPModule._get_fsdp_state", lambda: fsdp2_module_type()._get_fsdp_state),  # type: ignore[union-attr]
)
