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


_DCP = "torch.distributed.checkpoint."
_DCP_PRIVATES = (
    ("_traverse", "set_element"),
    ("state_dict", "_patched_state_dict"),
    ("filesystem", "_StorageInfo"),
    ("metadata", "_MEM_FORMAT_ENCODING"),
)

#: Every torch private the modules of ``torch_compat`` use, as ``(dotted name, resolver)``; a resolver raises
#: when the installed torch no longer has the private. Instance attributes (``DTensor._local_tensor``,
#: ``FSDPParam._orig_size``...) are checked on live objects by the tests.
PRIVATE_APIS: tuple[tuple[str, Callable[[], Any]], ...] = (
    (
        "torch.distributed.checkpoint._nested_dict.flatten_state_dict",
        lambda: resolve("torch.distributed.checkpoint._nested_dict", "flatten_state_dict"),
    ),
    *(
        (f"torch.distributed.checkpoint.{module}.{name}", lambda m=module, n=name: resolve(_DCP + m, n))
        for module, name in _DCP_PRIVATES
    ),
    ("torch.serialization._get_layout", lambda: resolve("torch.serialization", "_get_layout")),
    ("FileSystemReader._get_metadata_path", lambda: FileSystemReader._get_metadata_path),
    ("torch.optim.lr_scheduler._LRScheduler", lambda: resolve("torch.optim.lr_scheduler", "_LRScheduler")),
    ("torch.nn.modules.batchnorm._NormBase", lambda: resolve("torch.nn.modules.batchnorm", "_NormBase")),
    ("torch.Tensor._base", lambda: torch.Tensor._base),
    (
        "torch.distributed.distributed_c10d._get_default_store",
        lambda: resolve("torch.distributed.distributed_c10d", "_get_default_store"),
    ),
    (
        "torch.autograd.Variable._execution_engine.queue_callback",
        lambda: torch.autograd.Variable._execution_engine.queue_callback,
    ),
    ("FSDPModule._get_fsdp_state", lambda: fsdp2_module_type()._get_fsdp_state),  # type: ignore[union-attr]
    (
        "torch._dynamo.eval_frame.OptimizedModule",
        lambda: resolve("torch._dynamo.eval_frame", "OptimizedModule"),
    ),
    (f"{FAKE_TENSOR_MODULE}.FakeTensorMode", lambda: resolve(FAKE_TENSOR_MODULE, "FakeTensorMode")),
    (f"{MEM_TRACKER_MODULE}.MemTracker", lambda: resolve(MEM_TRACKER_MODULE, "MemTracker")),
    (f"{FAKE_PG_MODULE}.FakeStore", lambda: resolve(FAKE_PG_MODULE, "FakeStore")),
    (
        "torch.distributed._compute_bucket_assignment_by_size",
        lambda: resolve("torch.distributed", "_compute_bucket_assignment_by_size"),
    ),
    (
        "torch.utils._python_dispatch.TorchDispatchMode",
        lambda: resolve("torch.utils._python_dispatch", "TorchDispatchMode"),
    ),
    ("torch.utils._pytree.tree_flatten", lambda: resolve("torch.utils._pytree", "tree_flatten")),
    ("torch.utils._pytree.tree_unflatten", lambda: resolve("torch.utils._pytree", "tree_unflatten")),
    ("torch.UntypedStorage._cdata", lambda: torch.UntypedStorage(0)._cdata),
    ("torch.nn.Module._apply", lambda: torch.nn.Module._apply),
    (
        "torch.distributed._DEFAULT_FIRST_BUCKET_BYTES",
        lambda: resolve("torch.distributed", "_DEFAULT_FIRST_BUCKET_BYTES"),
    ),
)
