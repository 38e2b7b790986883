# SPDX-License-Identifier: Apache-2.0
"""warn_slow_precision: fp16 on a CPU device is said once, with the faster choice and its measured figure."""

from __future__ import annotations

import warnings

import pytest
import torch

from stepforge.core.precision import SlowConfigurationWarning, warn_slow_precision
from stepforge.core.precision import _slow as slow_module


@pytest.fixture(autouse=True)
def _fresh_process_memory(monkeypatch):
    monkeypatch.setattr(slow_module, "_said", set())


def _quiet(*args, **kwargs) -> bool:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        emitted = warn_slow_precision(*args, **kwargs)
    assert caught == [], [str(w.message) for w in caught]
    return emitted


def _boost() -> bool:  # stands for Booster.boost: the note points at the line that called it
    return warn_slow_precision("fp16", torch.device("cpu"), where="Booster.boost(plugin='zero2')")


def test_fp16_on_cpu_is_said_once_naming_bf16_and_the_figure():
    with pytest.warns(SlowConfigurationWarning) as record:
        assert _boost() is True
    (note,) = record
    text = str(note.message)
    assert text.startswith("Booster.boost(plugin='zero2'): precision 'fp16' runs on a CPU device")
    assert "precision='bf16'" in text and "about 25x" in text
    assert note.filename == __file__
    # once per process: neither again nor through fp16_apex (which runs as fp16) nor another CPU device string
    assert _quiet("fp16", "cpu", where="again") is False
    assert _quiet("fp16_apex", "cpu", where="again") is False


@pytest.mark.parametrize(
    ("precision", "device"),
    [("bf16", "cpu"), ("fp32", "cpu"), (None, "cpu"), ("fp16", "cuda"), ("fp16", torch.device("meta"))],
)
def test_nothing_is_said_for_fast_configurations(precision, device):
    assert _quiet(precision, device, where="Booster.boost") is False


def test_fp16_apex_counts_as_fp16():
    with pytest.warns(SlowConfigurationWarning, match="precision 'fp16' runs on a CPU device"):
        assert warn_slow_precision("FP16ApexMixedPrecision", "cpu", where="Booster") is True
