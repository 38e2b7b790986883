# SPDX-License-Identifier: Apache-2.0
"""What the step machinery of the fused optimizers needs from the optimizer that owns it.

:class:`~._base.FusedOptimizerBase` owns four objects (:class:`~._bucket_cache.BucketCache`,
:class:`~._skips.SkipTracker`, :class:`~._amp.AmpUnscaler`, :class:`~._host_step.HostLoop` /
:class:`~._device_step.DeviceLoop`); they receive the optimizer as this protocol at each call (never store it,
so no reference cycle keeps an optimizer alive) and reach the subclass hooks only through it.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Protocol

import torch

from ._buckets import Bucket, Launch

__all__ = ["KernelOwner"]


class KernelOwner(Protocol):
    """The optimizer seen by its step machinery: options, the subclass hooks and the device helpers."""

    #: class name used in messages
    _owner: str
    #: whether the optimizer keeps a per-parameter ``step`` (False for SGD)
    _uses_steps: bool
    #: float32 masters for fp16/bf16 params
    master_weights: bool
    param_groups: list[dict[str, Any]]

    def _state_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        """float32 state tensors shaped like the param, in kernel argument order."""
        ...

    def _init_state(
        self, p: torch.Tensor, group: dict[str, Any], moved: bool = False
    ) -> tuple[dict[str, Any], bool]:
        """Create or normalise ``p``'s state; returns ``(state, created_now)``."""
        ...

    def _launch(
        self, module: ModuleType, bucket: Bucket, group: dict[str, Any], launch: Launch
    ) -> bool | None:
        """Run the kernel on ``bucket``; returns whether its finite check skipped the update."""
        ...

    def _pre_step(self, plans: list[tuple[dict[str, Any], list[Bucket]]], divisor: float) -> float:
        """Adjust the host grad divisor before any update (LAMB's clip)."""
        ...

    def _device_clip_norm(self) -> float:
        """Global grad-norm clip on the device path (``0``: none)."""
        ...

    def _device_path(self, device: torch.device) -> bool:
        """Whether tensors on ``device`` take the sync-free device path."""
        ...

    def _device_env(self, device: torch.device) -> tuple[int, int]:
        """``(stream handle, device index)`` of a launch on ``device``."""
        ...

    def _ctx(self, module: ModuleType, device: torch.device) -> int:
        """CPU threads or CUDA stream handle of a launch."""
        ...

    def _device_kw(self, device: torch.device) -> dict[str, Any]:
        """Extra keywords of a launch on ``device`` (the CUDA device index)."""
        ...
