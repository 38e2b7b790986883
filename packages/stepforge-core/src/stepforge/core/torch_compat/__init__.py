# SPDX-License-Identifier: Apache-2.0
"""stepforge.core.torch_compat: the one public module through which stepforge uses torch private APIs.

Each wrapper names the private it needs in :data:`PRIVATE_APIS`; ``tests/torch_compat/test_wrappers.py`` resolves every
entry and exercises every wrapper on real torch objects, so a torch update that renames or removes one fails
there, naming the private and the torch version, instead of deep inside a training step. Where torch has a
public spelling it is used (``isinstance(t, DTensor)``, ``torch.distributed.fsdp.FSDPModule``,
``set_requires_gradient_sync``, ``DistributedDataParallel.no_sync``); the private is used only where torch
offers none. One module per area of torch, each listing the privates it needs and why:

- :mod:`.tensors`: DTensor's local shard (``DTensor._local_tensor``; the public ``to_local()`` is an
  autograd function that returns a new view on every call, while identity-keyed caches and in-place steps
  need the shard itself) and ``Tensor._base`` (flat-buffer views of fused buckets).
- :mod:`.base_classes`: ``nn.modules.batchnorm._NormBase`` (layers whose running statistics the forward
  updates) and ``torch.optim.lr_scheduler._LRScheduler`` (the base ColossalAI's schedulers subclass and its
  trainers check with ``isinstance``).
- :mod:`.runtime`: ``Variable._execution_engine.queue_callback`` (run a function when the backward pass
  ends) and ``distributed_c10d._get_default_store`` (arrival barriers with a timeout, which ``barrier()``
  lacks on gloo).
- :mod:`.dcp`: DCP's ``flatten_state_dict`` (the key layout DCP writes),
  :class:`SafeFileSystemReader` / :class:`SafeLoadPlanner`, which read DCP checkpoints without running code
  from them (DCP's metadata classes ``filesystem._StorageInfo``, ``metadata._MEM_FORMAT_ENCODING`` and
  ``_traverse.set_element``), and :func:`set_instance_state_dict`, a module's own ``state_dict`` that DCP's
  state-dict helpers step around (``state_dict._patched_state_dict``).
- :mod:`.fsdp2`: FSDP2's module class (in ``torch.distributed._composable.fsdp`` before torch 2.6) and
  its pending unsharded gradients (``FSDPModule._get_fsdp_state()._fsdp_param_group.fsdp_params``,
  ``FSDPParam._unsharded_param``, ``FSDPParam._orig_size``), which checkpoints inside an accumulation window
  need.
- :mod:`.dynamo`: ``torch._dynamo.eval_frame.OptimizedModule``, the wrapper ``torch.compile(module)`` returns
  (its keys carry ``_orig_mod.``), so the Booster can tell it apart (``compile=`` on it is refused).
- :mod:`.gradient_sync`: :func:`gradient_sync_off`, the ``no_sync`` adapter for torch DDP
  (``model.no_sync()``) and FSDP2 (``set_requires_gradient_sync(False)`` on every FSDP module of the
  target), used by :func:`stepforge.core.no_sync` and by the FSDP2 plugins: the one place FSDP2's switch is
  written.
- :mod:`.simulation`: planning and simulating a run without its memory: ``FakeTensorMode``
  (``torch._subclasses``), ``MemTracker`` (``torch.distributed._tools``), the ``"fake"`` process-group backend
  (``torch.testing._internal.distributed.fake_pg``) and DDP's bucket assignment
  (``torch.distributed._compute_bucket_assignment_by_size``).
- :mod:`.private_apis`: :data:`PRIVATE_APIS`, every private above with a resolver; :mod:`.errors`:
  :class:`TorchInternalsError`, raised when one of them changed.
"""

from __future__ import annotations

from .base_classes import LegacyLRScheduler, is_norm_with_running_stats
from .dcp import SafeFileSystemReader, SafeLoadPlanner, flatten_state_dict, set_instance_state_dict
from .dynamo import compiled_module_type, is_compiled_module
from .errors import TorchInternalsError
from .fsdp2 import (
    fsdp2_module_type,
    fsdp2_modules,
    fsdp2_param_shape,
    fsdp2_params,
    fsdp2_pending_grad,
    set_fsdp2_pending_grad,
)
from .gradient_sync import ddp_no_sync, fsdp2_no_sync, gradient_sync_off, is_ddp, supports_gradient_sync_off
from .private_apis import PRIVATE_APIS as PRIVATE_APIS  # for the tests; not re-exported by stepforge.core
from .runtime import default_store, queue_backward_callback
from .simulation import (
    ddp_bucket_assignment,
    fake_tensor_mode,
    memory_tracker,
    register_fake_backend,
    tracker_bytes,
    tracker_module_peaks,
)
from .tensors import dtensor_local, is_dtensor, view_base

__all__ = [
    "LegacyLRScheduler",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "TorchInternalsError",
    "compiled_module_type",
    "ddp_bucket_assignment",
    "ddp_no_sync",
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
    "queue_backward_callback",
    "set_fsdp2_pending_grad",
    "set_instance_state_dict",
    "supports_gradient_sync_off",
    "view_base",
]
