# SPDX-License-Identifier: Apache-2.0
"""Skip tracking of the fused optimizers: whether the last step was skipped and how many were, on the host or
on the device (where reading the answer synchronises, so it is read only when asked)."""

from __future__ import annotations

import torch

__all__ = ["SkipTracker"]


class SkipTracker:
    """Skipped steps decided on the host (a count and a flag) and on devices (flag tensors, never read inside
    ``step()``).

    Attributes:
        host_last: the last step was skipped by a host decision.
        host_count: steps skipped by host decisions (plus a value assigned to ``skipped_steps``).
        last_flags: the device flags of the last step (``!= 0``: skipped there).
        flags: one persistent float32 ``(1,)`` flag per device, the ``found_inf_ptr`` of its launches.
        counts: one float32 ``(1,)`` counter of device-decided skips per device.
    """

    __slots__ = ("counts", "flags", "host_count", "host_last", "last_flags")

    def __init__(self, host_last: bool = False, host_count: int = 0) -> None:
        self.host_last = host_last
        self.host_count = host_count
        self.last_flags: list[torch.Tensor] = []
        self.flags: dict[torch.device, torch.Tensor] = {}
        self.counts: dict[torch.device, torch.Tensor] = {}

    def begin_step(self) -> None:
        """A new step starts: nothing skipped yet."""
        self.host_last = False
        self.last_flags = []

    def skip_on_host(self) -> None:
        """The step was skipped by a host decision."""
        self.host_last = True
        self.host_count += 1

    def last_skipped(self) -> bool:
        """Whether the last step was skipped (reads the device flags: synchronises after a CUDA step)."""
        if self.host_last:
            return True
        return any(bool(f.ne(0).any()) for f in self.last_flags)

    def set_last(self, value: bool) -> None:
        self.host_last = bool(value)
        self.last_flags = []

    def skipped(self) -> int:
        """How many steps were skipped (device counters read on access)."""
        return self.host_count + sum(int(c.sum().item()) for c in self.counts.values())

    def set_skipped(self, value: int) -> None:
        self.host_count = int(value)
        self.counts = {}

    def device_flag(self, device: torch.device, found_inf: torch.Tensor | None) -> torch.Tensor:
        """``device``'s flag, set to GradScaler's ``found_inf`` (on the stream, no sync) or to 0."""
        flag = self.flags.get(device)
        if flag is None:
            flag = self.flags[device] = torch.zeros(1, dtype=torch.float32, device=device)
        if found_inf is not None:
            flag.copy_(found_inf.to(device=device, dtype=torch.float32, non_blocking=True).reshape(1))
        else:
            flag.zero_()
        return flag

    def record_device(self, device: torch.device, flag: torch.Tensor) -> None:
        """The step on ``device`` was decided by ``flag``: remember it and count it (on the device)."""
        self.last_flags.append(flag)
        count = self.counts.get(device)
        if count is None:
            count = self.counts[device] = torch.zeros(1, dtype=torch.float32, device=device)
        count.add_(flag.ne(0).to(torch.float32))
