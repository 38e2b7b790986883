# SPDX-License-Identifier: Apache-2.0
"""``HybridAdam``: CPU and CUDA parameters in one Adam (ColossalAI signature)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from stepforge.core import HyperParameterError

from .cpu_adam import CPUAdam

__all__ = ["HybridAdam"]


class HybridAdam(CPUAdam):
    """:class:`CPUAdam` under ColossalAI's ``HybridAdam`` name and signature.

    CPU params are stepped by the CPU kernel and CUDA params by one multi-tensor CUDA launch per bucket, each
    parameter with its own step count (ColossalAI uses the last parameter's step for the whole GPU launch).

    Args:
        model_params, lr, bias_correction, betas, eps, weight_decay, adamw_mode: as in :class:`CPUAdam`.
        nvme_offload_fraction: must be 0 (NVMe offload is not implemented). nvme_offload_dir: must be None.
        master_weights, skip_nonfinite: as in :class:`FusedAdam`.
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
        nvme_offload_dir: str | None = None,
        *,
        master_weights: bool = False,
        skip_nonfinite: bool | None = None,
        assume_stable_grads: bool = False,
        **defaults: Any,
    ) -> None:
        if nvme_offload_fraction not in (0, 0.0) or nvme_offload_dir is not None:
            raise HyperParameterError(
                "HybridAdam: NVMe offload (nvme_offload_fraction/nvme_offload_dir) is not supported; "
                "pass nvme_offload_fraction=0.0 and nvme_offload_dir=None."
            )
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
            master_weights=master_weights,
            skip_nonfinite=skip_nonfinite,
            assume_stable_grads=assume_stable_grads,
        )
