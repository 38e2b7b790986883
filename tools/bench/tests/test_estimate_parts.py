# SPDX-License-Identifier: Apache-2.0
"""The estimate benches' comparison with ``torch.cuda``'s counts and their device options, on the CPU: the ratios
of given estimated and measured figures (the expected values written out here), their summary, and
``bench_architectures.py``'s ``--device`` / ``--last-rank`` refused without ``--fake``, cuda taken by default
only where torch sees a GPU."""

from __future__ import annotations

import pytest
import torch

from bench.estimate import bench_architectures, bench_estimate
from bench.estimate._goals import cuda_judge, cuda_summary

#: what one CUDA rank measured: ``torch.cuda.memory_allocated`` after step 2, ``max_memory_allocated`` over it
MEASURED = dict(peak=5_000, cuda=dict(after_boost=600, after_step=1_000, peak=2_000))


@pytest.mark.parametrize(
    ("device_held", "device_peak", "held", "peak", "within"),
    [
        (950, 2_100, 0.95, 1.05, True),
        (1_000, 2_240, 1.0, 1.12, False),  # the peak 12% over
        (850, 2_000, 0.85, 1.0, False),  # the held total 15% under
        (1_080, 1_840, 1.08, 0.92, True),
    ],
)
def test_the_device_figures_are_judged_against_torch_cuda_within_ten_percent(
    device_held: int, device_peak: int, held: float, peak: float, within: bool
) -> None:
    # held_total and peak (device + host) are what the MemTracker comparison reads: not these ratios' inputs
    est = dict(device_held=device_held, device_peak=device_peak, held_total=9_999, peak=9_999)
    out = cuda_judge(est, MEASURED)
    assert out["cuda_ratios"] == pytest.approx(dict(held=held, peak=peak))
    assert out["cuda_within"] is within


def test_a_run_without_cuda_counts_has_no_cuda_ratios() -> None:
    assert cuda_judge(dict(device_held=1, device_peak=1), dict(peak=5_000)) == {}


def test_nothing_held_on_the_device_is_a_match_only_where_nothing_was_estimated() -> None:
    nothing = dict(cuda=dict(after_boost=0, after_step=0, peak=400))
    assert cuda_judge(dict(device_held=0, device_peak=400), nothing) == dict(
        cuda_ratios=dict(held=1.0, peak=1.0), cuda_within=True
    )
    assert cuda_judge(dict(device_held=64, device_peak=400), nothing) == dict(
        cuda_ratios=dict(held=None, peak=1.0), cuda_within=False
    )


def test_the_cuda_summary_ranges_over_the_rows_that_have_ratios() -> None:
    rows = [
        dict(cuda_ratios=dict(held=0.95, peak=1.05)),
        dict(cuda_ratios=dict(held=0.80, peak=None)),
        dict(cuda_ratios=dict(held=1.02, peak=1.20)),
        dict(ratios=dict(peak=1.0)),  # a CPU row
    ]
    assert cuda_summary(rows) == dict(
        held=dict(min=0.80, max=1.02, cases=3, within=2, goal=0.10),
        peak=dict(min=1.05, max=1.20, cases=2, within=1, goal=0.10),
    )
    assert cuda_summary([dict(ratios=dict(peak=1.0))]) == {}


@pytest.mark.parametrize("option", [["--device", "cpu"], ["--device", "cuda"], ["--last-rank"]])
def test_the_fake_group_options_are_refused_without_fake(
    option: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        bench_architectures.parse(["--worlds", "2", *option])
    assert exc.value.code == 2
    assert f"{option[0]} needs --fake" in capsys.readouterr().err


def test_the_device_defaults_to_cuda_only_where_torch_sees_a_gpu(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_architectures.parse(["--fake"]).device == "cpu"
    assert (
        bench_architectures.parse(["--worlds", "2"]).device is None
    )  # gloo ranks: the estimate's CPU device
    with pytest.raises(SystemExit):
        bench_architectures.parse(["--fake", "--device", "cuda"])
    assert "torch sees no GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # the same check in bench_estimate --fake-worlds
        bench_estimate.parse(["--fake-worlds", "8", "--device", "cuda"])
    assert "torch sees no GPU" in capsys.readouterr().err

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert bench_architectures.parse(["--fake", "--last-rank"]).device == "cuda"
    with pytest.raises(SystemExit):  # the plugins would place the model on the GPU all the same
        bench_architectures.parse(["--fake", "--device", "cpu"])
    assert "CUDA_VISIBLE_DEVICES" in capsys.readouterr().err
