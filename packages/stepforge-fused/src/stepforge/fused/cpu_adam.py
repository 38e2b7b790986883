# SPDX-License-Identifier: Apache-2.0
"""``CPUAdam``: ColossalAI's CPU-offload Adam signature over the multi-tensor kernels."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ._nvme import NvmeStateStore, check_nvme_args
from ._step.eager import fused_step
from ._validate import adam_defaults
from .fused_adam import AdamBase

__all__ = ["CPUAdam"]


class CPUAdam(AdamBase):
    """Adam/AdamW for (mostly) CPU-resident parameters, e.g. ZeRO/Gemini offload.

    CPU parameters go through the CPU SIMD kernel and CUDA parameters through the CUDA kernel, in one
    optimizer with per-parameter step counts; ``div_scale`` is honoured on every path (ColossalAI ignores it on
    its bf16 fallback). Same math and state as :class:`~stepforge.fused.FusedAdam`.

    - ``lr``, ``bias_correction``, ``betas``, ``eps``, ``weight_decay``, ``adamw_mode``: as in
      :class:`FusedAdam`.
    - ``master_weights``, ``skip_nonfinite``, ``assume_stable_grads``: as in :class:`FusedAdam`.

    Args:
        model_params: parameters or param-group dicts.
        nvme_offload_fraction: share (0..1) of the CPU parameters' elements whose float32 state
            (``exp_avg``, ``exp_avg_sq``, ``master_param``) lives in memory-mapped files, largest parameters
            first (ColossalAI's argument). The kernels step the mapped tensors in place; the page cache writes
            them to disk and can evict them, so the process's anonymous memory shrinks by that state. CUDA
            parameters are never offloaded.
        nvme_offload_dir: directory for those files (a fresh sub-directory is created in it); None: the system
            temp dir. The files are removed by :meth:`close` or when the optimizer is garbage collected.
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
        nvme_offload_fraction: float = 0.0,
        nvme_offload_dir: str | os.PathLike[str] | None = None,
        *,
        master_weights: bool = False,
        skip_nonfinite: bool | None = None,
        assume_stable_grads: bool = False,
    ) -> None:
        fraction = check_nvme_args(self._owner, nvme_offload_fraction, nvme_offload_dir)
        self.nvme_offload_fraction = fraction
        self._nvme = NvmeStateStore(self._owner, fraction, nvme_offload_dir) if fraction > 0 else None
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

    @property
    def nvme_offload_dir(self) -> str | None:
        """The directory holding the offloaded state files (None without NVMe offload)."""
        return self._nvme.path if self._nvme is not None else None

    def close(self) -> None:
        """Remove the NVMe offload files (no-op without offload). Do not step the optimizer afterwards."""
        if self._nvme is not None:
            self._nvme.close()

    def _adopt_state(self, p: torch.Tensor, state: dict[str, Any]) -> None:
        if self._nvme is not None:
            self._nvme.plan(q for g in self.param_groups for q in g["params"])
            self._nvme.adopt(p, state)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if self._nvme is not None:
            for group in self.param_groups:
                for p in group["params"]:
                    if self.state.get(p):
                        self._adopt_state(p, self.state[p])

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        # An unpickled copy keeps its state in memory (the files belong to the original optimizer).
        self.__dict__.setdefault("_nvme", None)
        self.__dict__.setdefault("nvme_offload_fraction", 0.0)

    def step(self, closure: Callable[[], Any] | None = None, div_scale: float = -1) -> Any:
        """One step; ``div_scale > 0`` divides every grad (loss scale x clip factor) inside the kernel."""
        return fused_step(self, closure, div_scale)
