# SPDX-License-Identifier: Apache-2.0
"""stepforge.fused: fused multi-tensor optimizers on CPU (SIMD + OpenMP) and CUDA.

- :class:`FusedAdam`, :class:`FusedLAMB`, :class:`FusedSGD`: ColossalAI/apex signatures, ``torch.optim``
  conventions and state layout (a ``torch.optim.AdamW`` checkpoint loads into ``FusedAdam`` and back).
- :class:`CPUAdam`, :class:`HybridAdam`: CPU and CUDA params in one optimizer, ``step(div_scale=...)``.
- ``master_weights=True`` on all of them: float32 masters for fp16/bf16 params, updated in one fused pass
  (grad unscale, inf/NaN check and skip, master update, low-precision copy).
- every kernel is also a torch operator (``torch.ops.stepforge_fused.adam_`` ..., :mod:`stepforge.fused.ops`), so
  ``torch.compile(optimizer.step, fullgraph=True)`` gives one graph with the kernels in it.
- :func:`cpu_features` reports the CPU kernel path picked at import (``STEPFORGE_CPU_ISA`` forces one);
  :func:`set_num_threads` sets the kernel threads (default: ``torch.get_num_threads()``).

Example::

    >>> opt = stepforge.fused.FusedAdam(model.parameters(), lr=1e-3, weight_decay=0.01)
"""

from __future__ import annotations

from . import ops
from ._backend import (
    BackendUnavailableError,
    cpu_features,
    get_num_threads,
    has_cuda,
    set_cpu_isa,
    set_num_threads,
)
from ._version import __version__
from .cpu_adam import CPUAdam
from .fused_adam import FusedAdam
from .fused_lamb import FusedLAMB
from .fused_sgd import FusedSGD
from .hybrid_adam import HybridAdam

__all__ = [
    "__version__",
    "BackendUnavailableError",
    "CPUAdam",
    "FusedAdam",
    "FusedLAMB",
    "FusedSGD",
    "HybridAdam",
    "cpu_features",
    "get_num_threads",
    "has_cuda",
    "ops",
    "set_cpu_isa",
    "set_num_threads",
]


def __dir__() -> list[str]:
    return list(__all__)
