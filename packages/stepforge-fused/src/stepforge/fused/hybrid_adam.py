# SPDX-License-Identifier: Apache-2.0
"""``HybridAdam``: CPU and CUDA parameters in one Adam (ColossalAI signature)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from .cpu_adam import CPUAdam

__all__ = ["HybridAdam"]


class HybridAdam(CPUAdam):
    """:class:`CPUAdam` under ColossalAI's ``HybridAdam`` name and signature.

    CPU params are stepped by the CPU kernel and CUDA params by one multi-tensor CUDA launch per bucket, each
    parameter with its own step count (ColossalAI uses the last parameter's step for the whole GPU launch).

    - ``model_params``, ``lr``, ``bias_correction``, ``betas``, ``eps``, ``weight_decay``, ``adamw_mode``: as in :class:`CPUAdam`.
    - ``nvme_offload_fraction``, ``nvme_offload_dir``: as in :class:`CPUAdam` (state of CPU parameters only).
    - ``master_weights``, ``skip_nonfinite``, ``assume_stable_grads``: as in :class:`FusedAdam`.

    Args:
        **defaults: extra group defaults ColossalAI accepts and ignores; rejected here if unknown.
    """

    _owner = "HybridAdam"

    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        adamw_mode: bool = True,
        nvme_offload_fraction: float = 0.0,
        nvme_offload_dir: str | os.PathLike[str] | None = None,
        *,
        master_weights: bool = False,
        skip_nonfinite: bool | None = None,
        assume_stable_grads: bool = False,
        **defaults: Any,
    ) -> None:
        if defaults:
            raise TypeError(f"HybridAdam: unexpected keyword arguments {sorted(defaults)}")
        super().__init__(
            model_params,
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            adamw_mode=adamw_mode,
            nvme_offload_fraction=nvme_offload_fraction,
            nvme_offload_dir=nvme_offload_dir,
            master_weights=master_weights,
            skip_nonfinite=skip_nonfinite,
            assume_stable_grads=assume_stable_grads,
        )
