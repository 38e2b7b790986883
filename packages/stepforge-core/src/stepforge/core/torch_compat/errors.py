# SPDX-License-Identifier: Apache-2.0
"""The error raised when a torch private that :mod:`stepforge.core.torch_compat` wraps is gone or changed."""

from __future__ import annotations

import torch

from ..errors import StepforgeError

__all__ = ["TorchInternalsError", "private_changed"]


class TorchInternalsError(StepforgeError, RuntimeError):
    """A torch private API stepforge relies on is missing or changed in the installed torch version."""


def private_changed(private: str, error: BaseException | None = None) -> TorchInternalsError:
    """The error for a torch private (``private``, dotted) that changed; names it and the torch version."""
    return TorchInternalsError(
        f"torch {torch.__version__} changed the private API {private!r} that stepforge.core.torch_compat wraps "
        f"({type(error).__name__}: {error}); update stepforge.core.torch_compat for this torch version, or "
        "install a torch version stepforge-core supports (see constraints/cpu.txt)."
    )
