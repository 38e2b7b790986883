# SPDX-License-Identifier: Apache-2.0
"""stepforge.core.torch_compat: the one public module through which stepforge uses torch private APIs.

Where torch has a public spelling it is used (``isinstance(t, DTensor)``, ``FSDPModule``,
``set_requires_gradient_sync``, ``DistributedDataParallel.no_sync``); a private only where torch offers none.
One module per area of torch (:mod:`.tensors`, :mod:`.base_classes`, :mod:`.runtime`, :mod:`.dcp`,
:mod:`.fsdp2`, :mod:`.gradient_sync`, :mod:`.simulation`), each naming in its docstring the privates it needs
and why. :data:`PRIVATE_APIS` (:mod:`.private_apis`) lists every one with a resolver;
``tests/torch_compat/test_wrappers.py`` resolves each and exercises every wrapper on real torch objects, so a
torch update that renames or removes one fails there, naming the private and the torch version
(:class:`TorchInternalsError`), instead of deep inside a training step.
"""

from __future__ import annotations

from .base_classes import (
    LegacyLRScheduler,
    compiled_module_type,
    is_compiled_module,
    is_norm_with_running_stats,
)
from .dcp import SafeFileSystemReader, SafeLoadPlanner, flatten_state_dict, set_instance_state_dict
from .errors import TorchInternalsError
from .fsdp2 import (
    fsdp2_module_type,
    fsdp2_modules,
    fsdp2_param_shape,
    fsdp2_params,
    fsdp2_pending_grad,
    set_fsdp2_pending_grad,
)
from .gradient_sync import fsdp2_no_sync, gradient_sync_off, is_ddp, supports_gradient_sync_off
from .private_apis import PRIVATE_APIS as PRIVATE_APIS  # for the tests; not re-exported by stepforge.core
from .runtime import (
    DispatchMode,
    apply_in_place,
    default_store,
    queue_backward_callback,
    storage_id,
    tree_flatten,
    tree_unflatten,
)
from .simulation import (
    ddp_bucket_assignment,
    fake_tensor_mode,
    memory_tracker,
    register_fake_backend,
    tracker_bytes,
    tracker_module_peaks,
)
from .tensors import dtensor_local, is_dtensor, make_wrapper_subclass, view_base

__all__ = [
    "DispatchMode",
    "LegacyLRScheduler",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "TorchInternalsError",
    "compiled_module_type",
    "ddp_bucket_assignment",
    "fake_tensor_mode",
    "memory_tracker",
    "register_fake_backend",
    "tracker_bytes",
    "tracker_module_peaks",
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
    "is_compiled_module",
    "is_ddp",
    "is_dtensor",
    "is_norm_with_running_stats",
    "make_wrapper_subclass",
    "queue_backward_callback",
    "set_fsdp2_pending_grad",
    "set_instance_state_dict",
    "supports_gradient_sync_off",
    "view_base",
    "apply_in_place",
    "storage_id",
    "tree_flatten",
    "tree_unflatten",
]
