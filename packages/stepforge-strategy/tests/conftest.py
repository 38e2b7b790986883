# SPDX-License-Identifier: Apache-2.0
"""The tests of stepforge-strategy, in folders by concern (docs/contributing.md, "Where tests go").

The helpers that tests of several folders share stay here, beside this file: ``_cases.py`` (a Booster run and its
reference) and ``_strategy_cases.py`` (a Strategy run). This folder goes on ``sys.path`` so that a test in any
folder imports them by name (``from _cases import boost``); the ranks that ``run_distributed`` spawns inherit it.
"""

from __future__ import annotations

import os
import sys

_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
