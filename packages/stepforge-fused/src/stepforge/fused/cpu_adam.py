# SPDX-License-Identifier: Apache-2.0
"""``CPUAdam``: ColossalAI's CPU-offload Adam signature over the multi-tensor kernels."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from ._adam_base import AdamBase, adam_defaults

__all__ = ["CPUAdam"]


class CPUAdam(AdamBase):
    """Adam/AdamW for (mostly) CPU-resident parameters, e.g. ZeRO/Gemini offload.

    CPU parameters go through the CPU SIMD kernel and CUDA parameters through the CUDA kernel, in one
    optimizer with per-parameter step counts; ``div_scale`` is honoured on every path (ColossalAI ignores it on
    its bf16 fallback). Same math and state as :class:`~stepforge.fused.FusedAdam`.

    Args:
        model_params: parameters or param-group dicts.
        lr, bias_correction, betas, eps, weight_decay, adamw_mode: as in :class:`FusedAdam`.
        master_weights, skip_nonfinite: as in :class:`FusedAdam`.
    """

    _owner = "CPUAdam"

    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        adamw_mode: bool = True,
        *,
        master_weights: bool = False,
        skip_nonfinite: bool | None = None,
        assume_stable_grads: bool = False,
    ) -> None:
        defaults = adam_defaults(
            self._owner,
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            adamw_mode=adamw_mode,
        )
        super().__init__(
            model_params,
            defaults,
            master_weights=master_weights,
            skip_nonfinite=skip_nonfinite,
            assume_stable_grads=assume_stable_grads,
        )

    def step(self, closure: Callable[[], Any] | None = None, div_scale: float = -1) -> Any:
        """One step; ``div_scale > 0`` divides every grad (loss scale x clip factor) inside the kernel."""
        return self._fused_step(closure, div_scale)
