# SPDX-License-Identifier: Apache-2.0
"""What the step machinery of the fused optimizers needs from the optimizer that owns it.

:class:`~stepforge.fused._base.FusedOptimizerBase` owns the step's stateful parts (:class:`~.buckets.BucketCache`,
:class:`~.eager.SkipTracker`, :class:`~.device.DeviceLoop`); they, the eager step (:mod:`.eager`) and the compiled
step (:mod:`.compiled`) receive the optimizer as this protocol at each call (never store it, so no reference
cycle keeps an optimizer alive) and reach the subclass hooks only through it.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol

import torch

from stepforge.core import GroupValidator

from .._backend import KernelSpec

if TYPE_CHECKING:
    from .buckets import Bucket, BucketCache, Launch
    from .device import DeviceLoop
    from .eager import SkipTracker

__all__ = ["KernelOwner"]


class KernelOwner(Protocol):
    """The optimizer seen by its step machinery: options, the subclass hooks and the device helpers."""

    _owner: str
    _kernel: KernelSpec
    #: whether the optimizer keeps a per-parameter ``step`` (False for SGD)
    _uses_steps: bool
    master_weights: bool
    #: skip a step with inf/NaN grads (None: with master_weights)
    skip_nonfinite: bool | None
    param_groups: list[dict[str, Any]]
    _skips: SkipTracker
    _bucket_cache: BucketCache
    _device_loop: DeviceLoop
    #: the param-group checks (``revalidate(param_groups)`` at each step)
    _groups: GroupValidator
    _compile_first_run: dict[int, list[torch.Tensor]]

    @property
    def _pre_step(self) -> Callable[[list[tuple[dict[str, Any], list[Bucket]]], float], float] | None: ...

    #: the float32 state tensors of ``group``'s params, in kernel argument order
    def _state_keys(self, group: dict[str, Any]) -> tuple[str, ...]: ...

    #: create or normalise ``p``'s state; returns ``(state, created now)``
    def _init_state(
        self, p: torch.Tensor, group: dict[str, Any], moved: bool = False
    ) -> tuple[dict[str, Any], bool]: ...

    #: fill the lists of ``group`` for a compiled step and return its bucket plans
    def _init_group(
        self,
        group: dict[str, Any],
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        state_a: list[torch.Tensor],
        state_b: list[torch.Tensor],
        masters: list[torch.Tensor],
        extras: list[torch.Tensor],
    ) -> tuple[tuple[Any, ...], ...]: ...

    #: run the kernel on ``bucket``; returns whether its finite check skipped the update
    def _launch(
        self, module: ModuleType, bucket: Bucket, group: dict[str, Any], at: Launch
    ) -> bool | None: ...

    #: global grad-norm clip on the device path (``0``: none)
    def _device_clip_norm(self) -> float: ...

    # the device helpers, reached through the optimizer so a test can route a device to an emulation
    def _device_path(self, device: torch.device) -> bool: ...
    def _device_env(self, device: torch.device) -> tuple[int, int]: ...
    def _ctx(self, module: ModuleType, device: torch.device) -> int: ...
    def _device_kw(self, device: torch.device) -> dict[str, Any]: ...
