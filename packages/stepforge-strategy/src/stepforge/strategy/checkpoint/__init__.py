# SPDX-License-Identifier: Apache-2.0
"""Crash-safe DCP directory checkpoints: commit marker with CRC-32 of every file, atomic rename,
``last_checkpoint``, rotation, RNG; loads that run no code from the files."""

from __future__ import annotations

from ._dcp import load_dir, read_dcp_metadata, read_meta, safe_dcp_load, save_dir, unblob
from ._layout import (
    LAST_CHECKPOINT,
    MARKER,
    CheckpointError,
    CheckpointMismatchError,
    committed_checkpoints,
    find_latest_checkpoint,
)
from ._rng import get_rng_state, set_rng_state

__all__ = [
    "LAST_CHECKPOINT",
    "MARKER",
    "CheckpointError",
    "CheckpointMismatchError",
    "committed_checkpoints",
    "find_latest_checkpoint",
    "get_rng_state",
    "load_dir",
    "read_dcp_metadata",
    "read_meta",
    "safe_dcp_load",
    "save_dir",
    "set_rng_state",
    "unblob",
]
