# SPDX-License-Identifier: Apache-2.0
"""Reference optimizers: plain per-parameter loops that every stepforge optimizer and kernel is checked against.

Each ``reference_*_step`` works in place on lists of tensors, computes in fp32 (fp64 for fp64 tensors, or
``math_dtype``) whatever the storage dtype, never writes the gradients, and documents its formulas in its
module docstring. ``Reference*`` classes wrap them as ``torch.optim.Optimizer`` subclasses.

- :mod:`.adam`: ``reference_adam_step`` / ``ReferenceAdam`` (apex ``FusedAdam`` math; Adam and AdamW).
- :mod:`.sgd`: ``reference_sgd_step`` / ``ReferenceSGD`` (``torch.optim.SGD``, apex ``wd_after_momentum``).
- :mod:`.lamb`: ``reference_lamb_step`` / ``ReferenceLamb`` (apex ``FusedLAMB``; ColossalAI ``Lamb`` by options).
- :mod:`.lars`: ``reference_lars_step`` / ``ReferenceLars`` (ColossalAI ``Lars`` + SGD dampening/nesterov).

Conventions shared by all: ``grad_scale`` is a loss scale (gradients are *divided* by it); ``steps`` entries
are the steps taken so far and are incremented in place before use; ``None`` momentum buffers are created.
"""

from __future__ import annotations

from .adam import ReferenceAdam, reference_adam_step
from .lamb import ReferenceLamb, reference_global_grad_norm, reference_lamb_step
from .lars import ReferenceLars, reference_lars_step
from .sgd import ReferenceSGD, reference_sgd_step

__all__ = [
    "ReferenceAdam",
    "ReferenceLamb",
    "ReferenceLars",
    "ReferenceSGD",
    "reference_adam_step",
    "reference_global_grad_norm",
    "reference_lamb_step",
    "reference_lars_step",
    "reference_sgd_step",
]
