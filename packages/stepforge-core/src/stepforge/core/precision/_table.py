# SPDX-License-Identifier: Apache-2.0
"""The precision table: every name a user may pass as ``precision=`` or ``mixed_precision=``, and what it means."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

from ..errors import HyperParameterError

__all__ = [
    "Precision",
    "PRECISIONS",
    "PLUGIN_PRECISIONS",
    "MIXED_PRECISIONS",
    "get_precision",
    "check_plugin_precision",
]


@dataclass(frozen=True)
class Precision:
    """One training precision: its canonical ``name`` and other ``aliases`` (case, ``_`` and ``-`` ignored); the
    ``dtype`` a plugin that owns precision casts the parameters (ZeRO) or their compute copy (FSDP2) to; the
    ``autocast_dtype`` the Booster applies around the forward (``None``: no autocast); whether it
    ``needs_loss_scaler`` (fp16's 5-bit exponent underflows) and is valid as a plugin's ``precision=``
    (``plugin_precision``); the precision it ``runs_as`` (``fp16_apex`` runs as ``fp16``; Apex is not used)."""

    name: str
    aliases: tuple[str, ...]
    dtype: torch.dtype
    autocast_dtype: torch.dtype | None
    needs_loss_scaler: bool
    plugin_precision: bool
    runs_as: str

    @property
    def param_dtype(self) -> torch.dtype | None:
        """FSDP2 ``MixedPrecisionPolicy.param_dtype``: ``None`` for fp32 (compute in the stored dtype)."""
        return None if self.dtype == torch.float32 else self.dtype


_ROWS = (
    Precision("fp32", ("no", "none", "float32"), torch.float32, None, False, True, "fp32"),
    Precision(
        "fp16", ("fp16torchmixedprecision", "float16"), torch.float16, torch.float16, True, True, "fp16"
    ),
    Precision(
        "bf16", ("bf16mixedprecision", "bfloat16"), torch.bfloat16, torch.bfloat16, False, True, "bf16"
    ),
    # fp8: torchao's float8 linear layers with bf16 autocast around the rest (strategy's FP8MixedPrecision)
    Precision("fp8", ("fp8mixedprecision",), torch.float8_e4m3fn, torch.bfloat16, False, False, "fp8"),
    Precision("fp16_apex", ("fp16apexmixedprecision",), torch.float16, torch.float16, True, False, "fp16"),
)

#: canonical name -> :class:`Precision`, in table order.
PRECISIONS: Mapping[str, Precision] = MappingProxyType({row.name: row for row in _ROWS})
#: the values a plugin that owns precision (ZeRO, FSDP2, gemini) takes as ``precision=``.
PLUGIN_PRECISIONS: tuple[str, ...] = tuple(row.name for row in _ROWS if row.plugin_precision)
#: the names the Booster takes as ``mixed_precision=`` (fp32 is spelled ``None``).
MIXED_PRECISIONS: tuple[str, ...] = ("fp16", "bf16", "fp8", "fp16_apex")


def _key(name: str) -> str:
    return name.strip().lower().replace("_", "").replace("-", "")


_BY_KEY: Mapping[str, Precision] = MappingProxyType(
    {_key(spelling): row for row in _ROWS for spelling in (row.name, *row.aliases)}
)
_BY_DTYPE: Mapping[torch.dtype, Precision] = MappingProxyType(
    {row.dtype: row for row in _ROWS if row.name == row.runs_as}
)


def get_precision(spec: str | torch.dtype | Precision, *, owner: str = "precision") -> Precision:
    """The table row of a name (any case, ``_``/``-`` ignored, aliases included) or a torch dtype.

    Raises:
        HyperParameterError: an unknown name or dtype; the message lists the names.
    """
    if isinstance(spec, Precision):
        return spec
    row = None
    if isinstance(spec, str):
        row = _BY_KEY.get(_key(spec))
    elif isinstance(spec, torch.dtype):
        row = _BY_DTYPE.get(spec)
    if row is None:
        raise HyperParameterError(
            f"{owner}: unknown precision {spec!r}; use one of {', '.join(map(repr, PRECISIONS))} "
            "(or a torch dtype float32/float16/bfloat16)."
        )
    return row


def check_plugin_precision(precision: str | torch.dtype | Precision, *, owner: str) -> str:
    """The canonical name of a plugin's ``precision=`` argument (``'fp32'``, ``'fp16'`` or ``'bf16'``).

    Raises:
        HyperParameterError: a name that is unknown or not a plugin precision (fp8, fp16_apex belong to the
            Booster's ``mixed_precision``), naming ``owner`` and the valid values.
    """
    try:
        row: Precision | None = get_precision(precision, owner=owner)
    except HyperParameterError:
        row = None
    if row is None or not row.plugin_precision:
        raise HyperParameterError(
            f"{owner}: precision must be one of {', '.join(map(repr, PLUGIN_PRECISIONS))}, got {precision!r}."
        )
    return row.name
