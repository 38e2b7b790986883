# SPDX-License-Identifier: Apache-2.0
"""Every checkpoint of stepforge.strategy lives here: the one writer and its layouts, and what saves through it.

- the writer (``_writer.py``): directories committed with a marker holding the CRC-32 of every file (atomic
  rename, ``last_checkpoint``, rotation after the commit); single files with a sidecar manifest (atomic replace);
  several files added to a directory the user names (``_publish.py``); one outcome on every rank (``_agree.py``);
  which names a save may take (``_names.py``);
- the Strategy's checkpoints (``_strategy_io.py``, ``_strategy_load.py``, ``_auto_resume.py``) on DCP (``_dcp.py``);
- the Booster's (``booster.checkpoint_io``, whose ColossalAI facade is :mod:`stepforge.strategy.checkpoint_io`): the
  Hugging Face model layout (``_hf_layout.py``, ``_model_io.py``), boosted optimizers on DCP (``_optim_io.py``,
  with ``_optim_template.py`` fitting the load template), plain optimizers (``_plain_optim.py``), asynchronous
  writes (``_pending.py``);
- loads verify first, read into fresh tensors, and run no code from the files;
- the ``stepforge-checkpoint`` command (``cli.py``): inspect any of these saves, export its model as one Hugging
  Face directory.
"""

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
from ._sidecar import read_torch_file, write_with_sidecar
from ._writer import (
    SIDECAR_SUFFIX,
    begin_dir,
    check_name,
    check_target,
    commit_dir,
    commit_dir_here,
    commit_file,
    commit_files,
    finish_dir,
    verify_dir,
    verify_file,
    write_file,
    write_files,
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
    "commit_files",
    "finish_dir",
    "read_torch_file",
    "write_with_sidecar",
    "verify_dir",
    "verify_file",
    "write_file",
    "write_files",
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
