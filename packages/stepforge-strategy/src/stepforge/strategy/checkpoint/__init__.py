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

from ._auto_resume import check_resume_option, checkpoint_to_resume
from ._dcp import load_dir, save_dir
from ._layout import CheckpointError, CheckpointMismatchError, find_latest_checkpoint
from ._model_io import (
    claim_model_target,
    gather_full_state_dict,
    load_model,
    save_model,
    write_full_state_dict,
)
from ._optim_io import load_lr_scheduler, load_optimizer, save_lr_scheduler, save_optimizer
from ._pending import PendingWrites, staged
from ._plain_optim import (
    claim_plain_target,
    load_plain_optimizer,
    save_plain_optimizer,
    write_plain_optimizer,
)
from ._run_state import RunState
from ._sidecar import read_torch_file
from ._strategy_io import save_checkpoint
from ._strategy_load import load_checkpoint, resume_checkpoint
from ._writer import commit_file, commit_files, verify_dir

# What the folder's callers use and nothing else: the Strategy's run state and checkpoints, the Booster's IO
# functions (checkpoint_io.py), the one writer's single-file commit and reader, its DCP directories (the
# checkpoint benchmark), and the errors.
__all__ = [
    "CheckpointError",
    "CheckpointMismatchError",
    "PendingWrites",
    "RunState",
    "check_resume_option",
    "checkpoint_to_resume",
    "claim_model_target",
    "claim_plain_target",
    "commit_file",
    "commit_files",
    "find_latest_checkpoint",
    "gather_full_state_dict",
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
    "write_full_state_dict",
    "write_plain_optimizer",
]
