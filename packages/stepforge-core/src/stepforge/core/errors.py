# SPDX-License-Identifier: Apache-2.0
"""Exceptions shared by every stepforge package."""

from __future__ import annotations

__all__ = [
    "StepforgeError",
    "HyperParameterError",
    "RegistryError",
    "UnknownNameError",
    "DuplicateNameError",
    "OptimizerStateError",
]


class StepforgeError(Exception):
    """Base class of every error raised on purpose by stepforge."""


class HyperParameterError(StepforgeError, ValueError):
    """A hyper-parameter is outside its allowed range or of the wrong type.

    Subclasses ``ValueError`` so code written for ``torch.optim`` (which raises ``ValueError``) keeps working.
    """


class RegistryError(StepforgeError, LookupError):
    """A registry lookup or registration failed."""


class UnknownNameError(RegistryError, KeyError):
    """No registry entry has that name. The message lists the names that exist and what to install."""

    def __str__(self) -> str:  # KeyError would wrap the message in quotes
        return str(self.args[0]) if self.args else ""


class DuplicateNameError(RegistryError):
    """Two distributions (or a distribution and an in-process registration) claim one name."""


class OptimizerStateError(StepforgeError, RuntimeError):
    """An optimizer's state layout cannot be read before training (it cannot be stepped on stand-in parameters,
    or its state is not sized by each parameter alone); the message names the optimizer and why."""
