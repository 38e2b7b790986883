# SPDX-License-Identifier: Apache-2.0
"""What the step machinery of the fused optimizers needs from the optimizer that owns it.

:class:`~stepforge.fused._base.FusedOptimizerBase` owns four objects (:class:`~.buckets.BucketCache`,
:class:`~.eager.SkipTracker`, :class:`~.eager.AmpUnscaler`, :class:`~.eager.HostLoop` /
:class:`~.device.DeviceLoop`); they, and the compiled step (:mod:`.compiled`), receive the optimizer
as this protocol at each call (never store it, so no reference cycle keeps an optimizer alive) and reach the
subclass hooks only through it. It extends :class:`~.buckets.BucketOwner`, what the bucket cache needs. The
modules of the eager and device loops import this one, so their objects are typed ``Any`` here (no import
circle).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any, Protocol

import torch

from stepforge.core import GroupValidator

from .buckets import Bucket, BucketCache, BucketOwner, Launch

__all__ = ["KernelOwner"]


class KernelOwner(BucketOwner, Protocol):
    """The optimizer seen by its step machinery: options, the subclass hooks and the device helpers."""

    #: skip a step with inf/NaN grads (None: with master_weights)
    skip_nonfinite: bool | None
    param_groups: list[dict[str, Any]]
    #: the :class:`~.eager.AmpUnscaler`
    _amp: Any
    #: the :class:`~.eager.SkipTracker`
    _skips: Any
    _bucket_cache: BucketCache
    #: the :class:`~.eager.HostLoop` and :class:`~.device.DeviceLoop`
    _host_loop: Any
    _device_loop: Any
    #: the param-group checks (``revalidate(param_groups)`` at each step)
    _groups: GroupValidator
    #: ``id(group)`` -> SGD first-run flag tensors a compiled step reads (kept alive by the optimizer)
    _compile_first_run: dict[int, list[torch.Tensor]]

    def _init_group(
        self,
        group: dict[str, Any],
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        state_a: list[torch.Tensor],
        state_b: list[torch.Tensor],
        masters: list[torch.Tensor],
        extras: list[torch.Tensor],
    ) -> tuple[tuple[Any, ...], ...]:
        """Fill the lists of ``group`` for a compiled step and return its bucket plans."""
        ...

    def _launch(
        self, module: ModuleType, bucket: Bucket, group: dict[str, Any], launch: Launch
    ) -> bool | None:
        """Run the kernel on ``bucket``; returns whether its finite check skipped the update."""
        ...

    #: adjusts the host grad divisor before any update (LAMB's clip); None: no adjustment
    _pre_step: Callable[[list[tuple[dict[str, Any], list[Bucket]]], float], float] | None

    def _device_clip_norm(self) -> float:
        """Global grad-norm clip on the device path (``0``: none)."""
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
