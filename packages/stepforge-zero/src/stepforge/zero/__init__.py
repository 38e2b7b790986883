# SPDX-License-Identifier: Apache-2.0
"""stepforge.zero."""

from __future__ import annotations

from ._version import __version__

__all__ = ["__version__"]
