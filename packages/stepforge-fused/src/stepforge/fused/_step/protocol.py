# SPDX-License-Identifier: Apache-2.0
"""What the step machinery of the fused optimizers needs from the optimizer that owns it.

:class:`~stepforge.fused._base.FusedOptimizerBase` owns the step's stateful parts (:class:`~.buckets.BucketCache`,
:class:`~.device.SkipTracker`, :class:`~.device.DeviceLoop`); they, the eager step (:mod:`.eager`) and the compiled
step (:mod:`.compiled`) receive the optimizer as this protocol at each call (never store it, so no reference
cycle keeps an optimizer alive) and reach the subclass hooks only through it. It extends
:class:`~.buckets.BucketOwner`, what the bucket cache needs. The eager and device modules import this one, so
the objects they define are typed ``Any`` here (no import circle).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any, Protocol

import torch

from stepforge.core import GroupValidator

from .._backend import KernelSpec
from .buckets import Bucket, BucketCache, BucketOwner, Launch

__all__ = ["KernelOwner"]


class KernelOwner(BucketOwner, Protocol):
    """The optimizer seen by its step machinery: options, the subclass hooks and the device helpers."""

    _kernel: KernelSpec
    #: skip a step with inf/NaN grads (None: with master_weights)
    skip_nonfinite: bool | None
    param_groups: list[dict[str, Any]]
    #: the :class:`~.device.SkipTracker`
    _skips: Any
    _bucket_cache: BucketCache
    #: the :class:`~.device.DeviceLoop`
    _device_loop: Any
    #: the param-group checks (``revalidate(param_groups)`` at each step)
    _groups: GroupValidator
    _compile_first_run: dict[int, list[torch.Tensor]]

    @property
    def _pre_step(self) -> Callable[[list[tuple[dict[str, Any], list[Bucket]]], float], float] | None: ...

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
    def _device_env(self, device: torch.device) -> tuple[int, int]: ...
    def _ctx(self, module: ModuleType, device: torch.device) -> int: ...
    def _device_kw(self, device: torch.device) -> dict[str, Any]: ...
