# SPDX-License-Identifier: Apache-2.0
"""Property tests: Lars against stepforge.testing.reference.ReferenceLars for 20 steps, random everything."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stepforge.optim import Lars
from stepforge.testing.loops import assert_trajectories_close, run_steps
from stepforge.testing.reference import ReferenceLars

shapes_st = st.lists(st.lists(st.integers(1, 9), min_size=1, max_size=3).map(tuple), min_size=1, max_size=4)
dtype_st = st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16])


@st.composite
def options_st(draw):
    momentum = draw(st.sampled_from([0.0, 0.5, 0.9]))
    nesterov = momentum > 0 and draw(st.booleans())
    return {
        "lr": draw(st.sampled_from([1e-3, 0.05, 0.5])),
        "momentum": momentum,
        "eeta": draw(st.sampled_from([1e-3, 0.02, 1.0])),
        "weight_decay": draw(st.sampled_from([0.0, 5e-4, 0.1])),
        "epsilon": draw(st.sampled_from([0.0, 1e-8, 1e-2])),
        "dampening": 0.0 if nesterov else draw(st.sampled_from([0.0, 0.1, 0.5])),
        "nesterov": nesterov,
        "grad_clip": draw(st.sampled_from([None, 10.0, 0.5])),
        "trust_clip": draw(st.sampled_from([None, (0.0, 50.0), (0.0, 0.01), (0.5, None)])),
        "maximize": draw(st.booleans()),
        "foreach": draw(st.sampled_from([None, False])),
        "chunk_size": draw(st.sampled_from([None, 5, 64])),
    }


def _reference_kwargs(o: dict) -> dict:
    return {k: v for k, v in o.items() if k not in ("foreach", "chunk_size")}


@settings(max_examples=40, deadline=None)
@given(
    shapes=shapes_st,
    dtype=dtype_st,
    options=options_st(),
    seed=st.integers(0, 2**16),
    scale=st.sampled_from([1.0, 30.0]),
)
def test_lars_matches_reference_for_20_steps(shapes, dtype, options, seed, scale):
    got = run_steps(lambda ps: Lars(ps, **options), shapes, dtype, steps=20, seed=seed, grad_scale=scale)
    want = run_steps(
        lambda ps: ReferenceLars(ps, **_reference_kwargs(options)),
        shapes,
        dtype,
        steps=20,
        seed=seed,
        grad_scale=scale,
    )
    assert_trajectories_close(got, want, dtype)


@settings(max_examples=15, deadline=None)
@given(options=options_st(), seed=st.integers(0, 2**16))
def test_lars_groups_lars_false_and_exclusion_match_reference(options, seed):
    """Per-group hyper-parameters, a ColossalAI ``lars=False`` group, and ``exclude_from_adaptation``."""
    shapes = [(4, 3), (5,), (2, 2, 2), (6,)]

    def groups(ps):
        return [
            {"params": ps[:2]},
            {"params": ps[2:3], "lr": 0.01, "momentum": 0.5, "nesterov": False, "dampening": 0.0},
            {"params": ps[3:], "lars": False},
        ]

    options = {**options, "weight_decay": 0.01}
    got = run_steps(
        lambda g: Lars(g, **options, exclude_from_adaptation=Lars.exclude_bias_and_norm),
        shapes,
        torch.float64,
        steps=20,
        seed=seed,
        groups=groups,
        grad_scale=5.0,
    )
    want = run_steps(
        lambda g: ReferenceLars(
            g, **_reference_kwargs(options), exclude_from_adaptation=lambda p: p.ndim <= 1
        ),
        shapes,
        torch.float64,
        steps=20,
        seed=seed,
        groups=groups,
        grad_scale=5.0,
    )
    assert_trajectories_close(got, want, torch.float64)


def test_lars_defaults_are_colossalai_lars():
    """Defaults: ratio clamp [0, 50], element clamp 10, no dampening, buffer starts as a copy of d."""
    shapes = [(8, 8), (8,)]
    kw = dict(lr=0.1, momentum=0.9, weight_decay=1e-2)
    got = run_steps(lambda ps: Lars(ps, **kw), shapes, torch.float32, steps=20, seed=4, grad_scale=40.0)
    want = run_steps(
        lambda ps: ReferenceLars(ps, **kw, eeta=1e-3, epsilon=0.0, grad_clip=10.0, trust_clip=(0.0, 50.0)),
        shapes,
        torch.float32,
        steps=20,
        seed=4,
        grad_scale=40.0,
    )
    assert_trajectories_close(got, want, torch.float32)


def test_lars_intermittent_grads_match_reference():
    shapes = [(5, 5), (7,)]
    kw = dict(lr=0.1, momentum=0.9, weight_decay=1e-2)

    def skip(step, i):
        return (i == 0 and step < 3) or (i == 1 and step % 4 == 1)

    got = run_steps(lambda ps: Lars(ps, **kw), shapes, torch.float32, steps=20, seed=6, skip=skip)
    want = run_steps(lambda ps: ReferenceLars(ps, **kw), shapes, torch.float32, steps=20, seed=6, skip=skip)
    assert_trajectories_close(got, want, torch.float32)


def test_a_pickled_lars_keeps_its_exclusion_and_steps_as_the_original():
    """A pickle round trip (also how ``copy.copy`` copies an optimizer) keeps ``exclude_from_adaptation``: the
    copy's next step equals the original's."""
    import pickle

    torch.manual_seed(0)
    weight, bias = torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4))
    opt = Lars([weight, bias], lr=0.1, momentum=0.9, exclude_from_adaptation=Lars.exclude_bias_and_norm)
    weight.grad, bias.grad = torch.randn(4, 4), torch.randn(4)
    opt.step()
    twin = pickle.loads(pickle.dumps(opt))
    assert twin.exclude_from_adaptation is Lars.exclude_bias_and_norm
    twin_params = twin.param_groups[0]["params"]
    for mine, theirs in zip([weight, bias], twin_params, strict=True):
        theirs.grad = mine.grad.clone()
    opt.step()
    twin.step()
    assert all(torch.equal(a, b) for a, b in zip([weight, bias], twin_params, strict=True))
