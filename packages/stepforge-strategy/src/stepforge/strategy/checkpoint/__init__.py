# SPDX-License-Identifier: Apache-2.0
"""Every checkpoint of stepforge.strategy lives here: the one writer and what saves through it.

- what a committed save is on disk, and its verified readers (``_layout.py``); the one writer (``_writer.py``):
  directories committed with a marker holding every file's CRC-32, single files with a sidecar manifest, files
  added to a directory the user names, one outcome on every rank, which names a save may take; asynchronous
  writes (``_pending.py``);
- the Strategy's checkpoints (``_strategy_ckpt.py``, ``_auto_resume.py``, ``_rescale.py``, ``_fsdp_window.py``) on
  DCP (``_dcp.py``);
- the Booster's (``booster.checkpoint_io``, whose ColossalAI facade is :mod:`stepforge.strategy.checkpoint_io`): the
  Hugging Face model layout (``_model_io.py``), boosted and plain optimizers (``_optim_io.py``, with
  ``_optim_template.py`` fitting the load template);
- the ``stepforge-checkpoint`` command (``cli.py``): inspect any of these saves, export its model as one Hugging
  Face directory.

Loads verify first, read into fresh tensors, and run no code from the files.
"""

from __future__ import annotations

from ._auto_resume import check_resume_option, checkpoint_to_resume
from ._dcp import load_dir, save_dir
from ._layout import (
    CheckpointError,
    CheckpointMismatchError,
    find_latest_checkpoint,
    read_torch_file,
    verify_dir,
)
from ._model_io import load_model, save_model
from ._optim_io import (
    load_lr_scheduler,
    load_optimizer,
    load_plain_optimizer,
    save_lr_scheduler,
    save_optimizer,
    save_plain_optimizer,
)
from ._pending import PendingWrites, staged
from ._strategy_ckpt import RunState, load_checkpoint, resume_checkpoint, save_checkpoint
from ._writer import commit_file, commit_files

__all__ = [
    "CheckpointError",
    "CheckpointMismatchError",
    "PendingWrites",
    "RunState",
    "check_resume_option",
    "checkpoint_to_resume",
    "commit_file",
    "commit_files",
    "find_latest_checkpoint",
    "load_checkpoint",
    "load_dir",
    "load_lr_scheduler",
    "load_model",
    "load_optimizer",
    "load_plain_optimizer",
    "read_torch_file",
    "resume_checkpoint",
    "save_checkpoint",
    "save_dir",
    "save_lr_scheduler",
    "save_model",
    "save_optimizer",
    "save_plain_optimizer",
    "staged",
    "verify_dir",
]
