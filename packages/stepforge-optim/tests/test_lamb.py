# SPDX-License-Identifier: Apache-2.0
"""Property tests: Lamb against stepforge.testing.reference.ReferenceLamb for 20 steps, random everything."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepforge.optim import Lamb
from stepforge.testing.loops import assert_trajectories_close, run_steps
from stepforge.testing.reference import ReferenceLamb

shapes_st = st.lists(st.lists(st.integers(1, 9), min_size=1, max_size=3).map(tuple), min_size=1, max_size=4)
dtype_st = st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16])
options_st = st.fixed_dictionaries(
    {
        "lr": st.sampled_from([1e-3, 1e-2, 0.1]),
        "betas": st.tuples(st.sampled_from([0.0, 0.5, 0.9]), st.sampled_from([0.9, 0.99, 0.999])),
        "eps": st.sampled_from([1e-8, 1e-6, 1e-3]),
        "weight_decay": st.sampled_from([0.0, 0.01, 0.1]),
        "adam": st.booleans(),
        "bias_correction": st.booleans(),
        "bias_correction_mode": st.sampled_from(["step_size", "update"]),
        "always_adapt": st.booleans(),
        "max_grad_norm": st.sampled_from([None, 0.5, 1.0, 100.0]),
        "trust_clip": st.sampled_from([None, (0.01, 10.0), (0.5, None), (None, 0.2)]),
        "adam_w_mode": st.booleans(),
        "grad_averaging": st.booleans(),
        "maximize": st.booleans(),
        "foreach": st.sampled_from([None, False]),
        "chunk_size": st.sampled_from([None, 5, 64]),
    }
)


def _reference_kwargs(o: dict) -> dict:
    kw = {k: v for k, v in o.items() if k not in ("always_adapt", "foreach", "chunk_size", "max_grad_norm")}
    return {**kw, "use_nvlamb": o["always_adapt"], "max_grad_norm": o["max_grad_norm"]}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shapes=shapes_st, dtype=dtype_st, options=options_st, seed=st.integers(0, 2**16))
def test_lamb_matches_reference_for_20_steps(shapes, dtype, options, seed):
    got = run_steps(lambda ps: Lamb(ps, **options), shapes, dtype, steps=20, seed=seed)
    want = run_steps(
        lambda ps: ReferenceLamb(ps, **_reference_kwargs(options)), shapes, dtype, steps=20, seed=seed
    )
    assert_trajectories_close(got, want, dtype)


@settings(max_examples=15, deadline=None)
@given(options=options_st, seed=st.integers(0, 2**16), split=st.integers(1, 3))
def test_lamb_param_groups_match_reference(options, seed, split):
    """Two groups with their own lr/weight_decay/trust_clip; the clip norm spans both groups."""
    shapes = [(4, 3), (5,), (2, 2, 2), (6,)]
    options = {**options, "max_grad_norm": 1.0}

    def groups(ps):
        return [
            {"params": ps[:split]},
            {"params": ps[split:], "lr": 0.05, "weight_decay": 0.0, "trust_clip": (0.1, 2.0)},
        ]

    got = run_steps(lambda g: Lamb(g, **options), shapes, torch.float64, steps=20, seed=seed, groups=groups)
    want = run_steps(
        lambda g: ReferenceLamb(g, **_reference_kwargs(options)),
        shapes,
        torch.float64,
        steps=20,
        seed=seed,
        groups=groups,
    )
    assert_trajectories_close(got, want, torch.float64)


def test_lamb_defaults_are_colossalai_lamb():
    """Defaults: no bias correction, ratio always applied (even with wd=0), no clipping, no trust clamp."""
    shapes = [(8, 8), (8,)]
    for wd in (0.0, 0.01):
        got = run_steps(
            lambda ps, wd=wd: Lamb(ps, lr=1e-2, weight_decay=wd), shapes, torch.float32, steps=20, seed=1
        )
        want = run_steps(
            lambda ps, wd=wd: ReferenceLamb(
                ps,
                lr=1e-2,
                eps=1e-6,
                weight_decay=wd,
                bias_correction=False,
                use_nvlamb=True,
                max_grad_norm=None,
            ),
            shapes,
            torch.float32,
            steps=20,
            seed=1,
        )
        assert_trajectories_close(got, want, torch.float32)


def test_fused_lamb_preset_is_apex_fused_lamb():
    shapes = [(16, 4), (4,), (3, 3)]
    got = run_steps(
        lambda ps: Lamb.fused_lamb(ps, lr=1e-2), shapes, torch.float32, steps=20, seed=2, grad_scale=3.0
    )
    want = run_steps(
        lambda ps: ReferenceLamb(ps, lr=1e-2), shapes, torch.float32, steps=20, seed=2, grad_scale=3.0
    )
    assert_trajectories_close(got, want, torch.float32)


def test_mixed_grad_dtype_and_intermittent_grads_match_reference():
    """fp32 grads on bf16 params share no bucket with bf16 grads; params skipped some steps keep their own step."""
    shapes = [(5, 5), (7,), (3,)]

    def skip(step, i):
        return i == 1 and step % 3 == 0

    kw = dict(lr=1e-2, weight_decay=0.01, bias_correction=True, bias_correction_mode="update")
    got = run_steps(
        lambda ps: Lamb(ps, **kw),
        shapes,
        torch.bfloat16,
        steps=20,
        seed=3,
        grad_dtype=torch.float32,
        skip=skip,
    )
    want = run_steps(
        lambda ps: ReferenceLamb(ps, **kw, use_nvlamb=True, max_grad_norm=None),
        shapes,
        torch.bfloat16,
        steps=20,
        seed=3,
        grad_dtype=torch.float32,
        skip=skip,
    )
    assert_trajectories_close(got, want, torch.bfloat16)
