# SPDX-License-Identifier: Apache-2.0
"""The list of every torch private :mod:`stepforge.core.torch_compat` uses, each with a resolver.

``tests/torch_compat/test_wrappers.py`` resolves every entry, so a torch update that renames or removes one fails
there, naming the private and the torch version, instead of deep inside a training step.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader

from .fsdp2 import fsdp2_module_type
from .simulation import FAKE_PG_MODULE, FAKE_TENSOR_MODULE, MEM_TRACKER_MODULE

__all__ = ["PRIVATE_APIS", "resolve"]


def resolve(module: str, name: str) -> Any:
    """``module.name`` (``module`` imported by its dotted name); raises when torch no longer has it."""
    return getattr(importlib.import_module(module), name)


_DCP = "torch.distributed.checkpoint"
# (module, name) privates looked up with resolve()
_MODULE_PRIVATES = (
    (f"{_DCP}._nested_dict", "flatten_state_dict"),
    (f"{_DCP}._traverse", "set_element"),
    (f"{_DCP}.state_dict", "_patched_state_dict"),
    (f"{_DCP}.filesystem", "_StorageInfo"),
    (f"{_DCP}.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.serialization", "_get_layout"),
    ("torch.optim.lr_scheduler", "_LRScheduler"),
    ("torch.nn.modules.batchnorm", "_NormBase"),
    ("torch.distributed.distributed_c10d", "_get_default_store"),
    ("torch._dynamo.eval_frame", "OptimizedModule"),
    (FAKE_TENSOR_MODULE, "FakeTensorMode"),
    (MEM_TRACKER_MODULE, "MemTracker"),
    (FAKE_PG_MODULE, "FakeStore"),
    ("torch.distributed", "_compute_bucket_assignment_by_size"),
    ("torch.distributed", "_DEFAULT_FIRST_BUCKET_BYTES"),
    ("torch.utils._python_dispatch", "TorchDispatchMode"),
    ("torch.utils._pytree", "tree_flatten"),
    ("torch.utils._pytree", "tree_unflatten"),
)

#: Every torch private the modules of ``torch_compat`` use, as ``(dotted name, resolver)``; a resolver raises
#: when the installed torch no longer has the private. Instance attributes (``DTensor._local_tensor``,
#: ``FSDPParam._orig_size``...) are checked on live objects by the tests.
PRIVATE_APIS: tuple[tuple[str, Callable[[], Any]], ...] = (
    *((f"{m}.{n}", lambda m=m, n=n: resolve(m, n)) for m, n in _MODULE_PRIVATES),
    ("FileSystemReader._get_metadata_path", lambda: FileSystemReader._get_metadata_path),
    ("torch.Tensor._base", lambda: torch.Tensor._base),
    ("torch.Tensor._make_wrapper_subclass", lambda: torch.Tensor._make_wrapper_subclass),
    (
        "torch.autograd.Variable._execution_engine.queue_callback",
        lambda: torch.autograd.Variable._execution_engine.queue_callback,
    ),
    ("FSDPModule._get_fsdp_state", lambda: fsdp2_module_type()._get_fsdp_state),  # type: ignore[union-attr]
    ("torch.UntypedStorage._cdata", lambda: torch.UntypedStorage(0)._cdata),
    ("torch.nn.Module._apply", lambda: torch.nn.Module._apply),
)
