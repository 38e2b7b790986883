# SPDX-License-Identifier: Apache-2.0
"""mmengine-semantics param schedulers: written-out sequences and torch's own schedulers as references."""

from __future__ import annotations

import math

import pytest
import torch

from stepforge.strategy.schedulers import SCHEDULERS, build_param_scheduler


def _opt(lr: float = 1.0, groups: int = 1) -> torch.optim.Optimizer:
    return torch.optim.SGD(
        [{"params": [torch.nn.Parameter(torch.zeros(1))]} for _ in range(groups)], lr=lr, momentum=0.9
    )


def _run(cfgs, steps: int, **defaults) -> list[float]:
    opt = _opt()
    scheds = build_param_scheduler(cfgs, opt, **defaults)
    seq = []
    for _ in range(steps):
        seq.append(opt.param_groups[0]["lr"])
        opt.step()
        for s in scheds:
            s.step()
    return seq


WRITTEN = [
    (dict(type="LinearLR", start_factor=0.5, end=5, by_epoch=False), [0.5, 0.625, 0.75, 0.875, 1.0, 1.0]),
    (dict(type="ConstantLR", factor=0.5, end=3, by_epoch=False), [0.5, 0.5, 1.0, 1.0]),
    (dict(type="StepLR", step_size=2, gamma=0.1, by_epoch=False, end=100), [1, 1, 0.1, 0.1, 0.01]),
    (
        dict(type="MultiStepLR", milestones=[1, 3, 3], gamma=0.1, by_epoch=False, end=100),
        [1, 0.1, 0.1, 0.001, 0.001],
    ),
    (dict(type="ExponentialLR", gamma=0.5, by_epoch=False, end=100), [1, 0.5, 0.25, 0.125]),
    (dict(type="PolyLR", eta_min=0.0, power=1.0, by_epoch=False, end=5), [1, 0.75, 0.5, 0.25, 0.0, 0.0]),
]


@pytest.mark.parametrize(("cfg", "expected"), WRITTEN, ids=[c["type"] for c, _ in WRITTEN])
def test_written_sequences(cfg, expected):
    assert _run(cfg, len(expected)) == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_warmup_then_cosine_chain():
    """mmengine's usual recipe: LinearLR over [0, 3), CosineAnnealingLR over [3, 7): closed-form values."""
    cfg = [
        dict(type="LinearLR", start_factor=0.25, begin=0, end=3, by_epoch=False),
        dict(type="CosineAnnealingLR", eta_min=0.1, begin=3, end=7, by_epoch=False),
    ]
    got = _run(cfg, 9)
    warm = [0.25, 0.625, 1.0]
    cos = [0.1 + 0.9 * (1 + math.cos(math.pi * k / 4)) / 2 for k in range(4)]
    assert got == pytest.approx(warm + cos + [cos[-1], cos[-1]], rel=1e-12)


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        (
            dict(type="LinearLR", start_factor=0.1, end_factor=0.9, end=11),
            ("LinearLR", dict(start_factor=0.1, end_factor=0.9, total_iters=10)),
        ),
        (
            dict(type="CosineAnnealingLR", T_max=7, eta_min=0.05, end=100),
            ("CosineAnnealingLR", dict(T_max=7, eta_min=0.05)),
        ),
        (
            dict(type="OneCycleLR", eta_max=2.0, total_steps=20, pct_start=0.25, end=100),
            ("OneCycleLR", dict(max_lr=2.0, total_steps=20, pct_start=0.25)),
        ),
        (
            dict(
                type="OneCycleLR",
                eta_max=2.0,
                total_steps=20,
                three_phase=True,
                anneal_strategy="linear",
                end=100,
            ),
            ("OneCycleLR", dict(max_lr=2.0, total_steps=20, three_phase=True, anneal_strategy="linear")),
        ),
    ],
    ids=["linear", "cosine-T_max-cycles", "onecycle-cos", "onecycle-3phase-linear"],
)
def test_matches_torch(ours, theirs):
    """Where torch has the same schedule (begin=0), the chainable form gives torch's values."""
    steps = 20 if "OneCycle" in ours["type"] else 30
    got = _run(dict(ours, by_epoch=False), steps)
    opt = _opt()
    ref_sched = getattr(torch.optim.lr_scheduler, theirs[0])(opt, **theirs[1])
    ref = []
    for _ in range(steps):
        ref.append(opt.param_groups[0]["lr"])
        opt.step()
        ref_sched.step()
    assert got == pytest.approx(ref, rel=1e-9, abs=1e-12)


def test_end_defaults_and_convert_to_iter_based():
    with pytest.raises(ValueError, match="max_epochs"):
        _run(dict(type="LinearLR"), 1)
    with pytest.raises(ValueError, match="max_iters"):
        _run(dict(type="LinearLR", by_epoch=False), 1)
    # by_epoch default True: end = max_epochs
    (s,) = build_param_scheduler(dict(type="LinearLR", start_factor=0.5), _opt(), max_epochs=3)
    assert (s.begin, s.end, s.by_epoch) == (0, 3, True)
    # convert: 1 epoch = 4 iterations; step_size 1 epoch -> 4 iterations; end 2 epochs -> 8
    cfg = dict(type="StepLR", step_size=1, gamma=0.5, end=2, convert_to_iter_based=True)
    (s,) = build_param_scheduler(cfg, _opt(), epoch_length=4)
    assert (s.step_size, s.begin, s.end, s.by_epoch) == (4, 0, 8, False)
    assert _run(cfg, 10, epoch_length=4) == [1, 1, 1, 1, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]
    with pytest.raises(ValueError, match="epoch_length"):
        build_param_scheduler(cfg, _opt())
    with pytest.raises(ValueError, match="by_epoch=True"):
        build_param_scheduler(dict(cfg, by_epoch=False), _opt(), epoch_length=4)


def test_torch_names_state_dict_and_errors():
    opt = _opt()
    (s,) = build_param_scheduler(dict(type="PolynomialLR", total_iters=4, power=2.0), opt)
    assert isinstance(s, torch.optim.lr_scheduler.PolynomialLR) and s.by_epoch is True
    with pytest.raises(ValueError, match="'begin' is not supported"):
        build_param_scheduler(dict(type="PolynomialLR", begin=2), _opt())
    with pytest.raises(ValueError, match="unknown param_scheduler type 'Nope'"):
        build_param_scheduler(dict(type="Nope"), _opt())
    with pytest.raises(ValueError, match="end must be larger than begin"):
        build_param_scheduler(dict(type="LinearLR", begin=3, end=3), _opt())
    with pytest.raises(ValueError, match="start_factor"):
        build_param_scheduler(dict(type="LinearLR", start_factor=2.0, end=3), _opt())
    # generic param scheduler on momentum, and state_dict round trip mid-schedule
    opt = _opt()
    (m,) = build_param_scheduler(
        dict(type="LinearParamScheduler", param_name="momentum", start_factor=0.5, end=3, by_epoch=False), opt
    )
    assert opt.param_groups[0]["momentum"] == pytest.approx(0.45)
    m.step()
    sd = m.state_dict()
    opt2 = _opt()
    opt2.param_groups[0]["momentum"] = opt.param_groups[0]["momentum"]
    opt2.param_groups[0]["initial_momentum"] = 0.9
    (m2,) = build_param_scheduler(
        dict(type="LinearParamScheduler", param_name="momentum", start_factor=0.5, end=3, by_epoch=False),
        opt2,
    )
    m2.load_state_dict(sd)
    opt2.param_groups[0]["momentum"] = opt.param_groups[0]["momentum"]
    m.step()
    m2.step()
    assert opt2.param_groups[0]["momentum"] == opt.param_groups[0]["momentum"] == pytest.approx(0.9)
    assert set(SCHEDULERS) >= {
        "LinearLR",
        "ConstantLR",
        "CosineAnnealingLR",
        "ExponentialLR",
        "MultiStepLR",
        "StepLR",
        "PolyLR",
        "OneCycleLR",
    }
