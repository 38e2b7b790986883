# SPDX-License-Identifier: Apache-2.0
"""Timing hooks of a ZeRO step: ``opt.observe_phases(observer)`` runs each phase inside ``observer(name)`` (a
context manager; ``None`` removes it, and each phase then costs one call returning a shared ``nullcontext``):

- ``"grad_to_pieces"``: a reduced bucket added into this rank's gradient pieces (under ``cpu_offload`` the
  device-to-host copy); the collective's own wait is outside.
- ``"inner_step"``: the inner optimizer's step over the master pieces (under ``cpu_offload``: the CPU step).
- ``"param_gather"``: the updated pieces into the working parameters and to the other ranks (with
  ``overlap_allgather`` over several ranks only the launch: the waits happen in the next forward).

The optimizer brackets only the host code that issues the work: an observer timing a device records device
events itself (e.g. ``torch.cuda.Event``).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

__all__ = ["PHASES", "PhaseObserver", "no_phase"]

#: the phase names, in the order a step meets them
PHASES = ("grad_to_pieces", "inner_step", "param_gather")

#: ``observer(phase_name)`` returns the context manager the optimizer runs that phase in
PhaseObserver = Callable[[str], AbstractContextManager[Any]]

_NOTHING: AbstractContextManager[None] = nullcontext()


def no_phase(name: str) -> AbstractContextManager[None]:
    """The observer in place when none is installed: a shared, reusable ``nullcontext``."""
    return _NOTHING
