# SPDX-License-Identifier: Apache-2.0
"""Timing hooks of a ZeRO step: the three places where ``LowLevelZeroOptimizer`` moves or updates its pieces,
each entered through an observer that a benchmark or a profiler installs.

``opt.observe_phases(observer)`` makes the optimizer run every phase inside ``observer(name)`` (a context
manager); ``opt.observe_phases(None)`` removes it. Without an observer each phase costs one call returning a shared
``nullcontext``. The phases, in the order a step meets them:

- ``"grad_to_pieces"``: a reduced gradient bucket added into this rank's fp32 gradient pieces, once per bucket
  (during backward, from the gradient hooks, or at the step's synchronisation). Under ``cpu_offload`` the pieces
  live on the host, so this is the device-to-host copy of the gradients. The collective's own wait is outside.
- ``"inner_step"``: the inner optimizer's step over the master pieces (under ``cpu_offload``: the CPU Adam step).
- ``"param_gather"``: the updated pieces copied into the working parameters and exchanged with the other ranks
  (under ``cpu_offload`` on one rank: the host-to-device copy of the parameters). With ``overlap_allgather`` over
  several ranks only the launch is inside; the waits happen in the next forward.

An observer that times a device must record device events itself (e.g. ``torch.cuda.Event`` at enter and exit):
the optimizer only brackets the host code that issues the work.
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
