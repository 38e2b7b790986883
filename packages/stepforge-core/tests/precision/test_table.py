# SPDX-License-Identifier: Apache-2.0
"""The precision table: names, aliases, dtypes, which precisions plugins take."""

from __future__ import annotations

import pytest
import torch

from stepforge.core import HyperParameterError
from stepforge.core.precision import (
    MIXED_PRECISIONS,
    PLUGIN_PRECISIONS,
    PRECISIONS,
    check_plugin_precision,
    get_precision,
)


def test_the_rows_written_out():
    rows = {
        name: (p.dtype, p.autocast_dtype, p.needs_loss_scaler, p.plugin_precision, p.runs_as, p.param_dtype)
        for name, p in PRECISIONS.items()
    }
    assert rows == {
        "fp32": (torch.float32, None, False, True, "fp32", None),
        "fp16": (torch.float16, torch.float16, True, True, "fp16", torch.float16),
        "bf16": (torch.bfloat16, torch.bfloat16, False, True, "bf16", torch.bfloat16),
        "fp8": (torch.float8_e4m3fn, torch.bfloat16, False, False, "fp8", torch.float8_e4m3fn),
        "fp16_apex": (torch.float16, torch.float16, True, False, "fp16", torch.float16),
    }
    assert PLUGIN_PRECISIONS == ("fp32", "fp16", "bf16")
    assert MIXED_PRECISIONS == ("fp16", "bf16", "fp8", "fp16_apex")


@pytest.mark.parametrize(
    ("spelling", "name"),
    [
        ("fp16", "fp16"), ("FP16", "fp16"), (" bf16 ", "bf16"), ("fp16-apex", "fp16_apex"),
        ("FP16ApexMixedPrecision", "fp16_apex"), ("fp16_torch_mixed_precision", "fp16"),
        ("BF16MixedPrecision", "bf16"), ("fp8_mixed_precision", "fp8"), ("no", "fp32"), ("None", "fp32"),
        (torch.float16, "fp16"), (torch.bfloat16, "bf16"), (torch.float32, "fp32"),
    ],
)  # fmt: skip
def test_aliases_and_dtypes_resolve(spelling, name):
    assert get_precision(spelling).name == name
    assert get_precision(get_precision(spelling)) is PRECISIONS[name]


@pytest.mark.parametrize("bad", ["fp64", "int8", "", torch.float64, 16, None])
def test_unknown_precision_names_the_choices(bad):
    with pytest.raises(
        HyperParameterError, match=r"Booster: unknown precision .*'fp32', 'fp16', 'bf16', 'fp8'"
    ):
        get_precision(bad, owner="Booster")


def test_plugin_precisions():
    assert [check_plugin_precision(p, owner="X") for p in ("fp32", "FP16", torch.bfloat16)] == [
        "fp32",
        "fp16",
        "bf16",
    ]
    for bad in ("fp8", "fp16_apex", "fp64", 3, None):
        with pytest.raises(
            HyperParameterError,
            match=r"^LowLevelZeroPlugin: precision must be one of 'fp32', 'fp16', 'bf16', got",
        ):
            check_plugin_precision(bad, owner="LowLevelZeroPlugin")
