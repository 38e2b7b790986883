# SPDX-License-Identifier: Apache-2.0
"""Crash-safe checkpoints: one writer for every save (directories: commit marker with CRC-32 of every file,
atomic rename, ``last_checkpoint``, rotation after the commit; single files: a sidecar manifest, atomic
replace), RNG; loads that verify first and run no code from the files."""

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
from ._sidecar import write_with_sidecar
from ._writer import (
    SIDECAR_SUFFIX,
    begin_dir,
    check_name,
    check_target,
    commit_dir,
    commit_dir_here,
    commit_file,
    finish_dir,
    verify_dir,
    verify_file,
)

__all__ = [
    "LAST_CHECKPOINT",
    "MARKER",
    "SIDECAR_SUFFIX",
    "begin_dir",
    "check_name",
    "check_target",
    "commit_dir",
    "commit_dir_here",
    "commit_file",
    "finish_dir",
    "write_with_sidecar",
    "verify_dir",
    "verify_file",
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
