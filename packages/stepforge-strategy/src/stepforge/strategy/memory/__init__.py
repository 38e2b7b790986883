# SPDX-License-Identifier: Apache-2.0
"""Memory and communication per rank before launch: :func:`estimate` and :class:`Estimate`.

``stepforge.strategy.estimate`` is :func:`estimate`; the console command ``stepforge-estimate`` prints the table
for several plugins side by side (:mod:`stepforge.strategy.memory.cli`).
"""

from __future__ import annotations

from ._activations import ActivationTrace, trace_activations
from ._auto import AUTO_CANDIDATES, AutoChoice, MemoryBudget, MemoryBudgetError, choose_plugin, memory_budget
from ._estimate import Estimate, estimate, make_plugin
from ._model import parameter_count, resolve_model
from ._table import estimate_table, format_bytes

__all__ = [
    "AUTO_CANDIDATES",
    "ActivationTrace",
    "AutoChoice",
    "MemoryBudget",
    "MemoryBudgetError",
    "choose_plugin",
    "memory_budget",
    "Estimate",
    "estimate",
    "estimate_table",
    "format_bytes",
    "make_plugin",
    "parameter_count",
    "resolve_model",
    "trace_activations",
]
