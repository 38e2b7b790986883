# SPDX-License-Identifier: Apache-2.0
"""Crash-safe checkpoints: one writer for every save (directories: commit marker with CRC-32 of every file,
atomic rename, ``last_checkpoint``, rotation after the commit; single files: a sidecar manifest, atomic
replace), RNG; loads that verify first and run no code from the files."""

from __future__ import annotations

from ._dcp import load_dir, read_dcp_metadata, read_meta, safe_dcp_load, save_dir, unblob
from ._layout import LAST_CHECKPOINT, MARKER, CheckpointError, committed_checkpoints, find_latest_checkpoint
from ._rng import get_rng_state, set_rng_state
from ._writer import SIDECAR_SUFFIX, check_name, commit_dir, commit_file, verify_dir, verify_file

__all__ = [
    "LAST_CHECKPOINT",
    "MARKER",
    "SIDECAR_SUFFIX",
    "check_name",
    "commit_dir",
    "commit_file",
    "verify_dir",
    "verify_file",
    "CheckpointError",
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
