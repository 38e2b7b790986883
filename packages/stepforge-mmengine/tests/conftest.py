# SPDX-License-Identifier: Apache-2.0
"""The tests of stepforge-mmengine, in folders by concern (docs/contributing.md, "Where tests go").

``_runs.py`` (the example config with per-run overrides, the crash and counting hooks) is shared by ``runner/``
and ``gpu/``; this folder goes on ``sys.path`` so that they import it by name, and spawned ranks inherit it.
"""

from __future__ import annotations

import os
import sys

_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
