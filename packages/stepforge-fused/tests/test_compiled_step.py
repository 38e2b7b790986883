# SPDX-License-Identifier: Apache-2.0
"""``torch.compile`` of the fused optimizers' step on the CPU: one graph without breaks, one compilation over
20 steps while an LR scheduler changes a tensor learning rate, the eager step's bits, no copy of the state.

Each test compiles once (inductor, a few seconds on 2 cores) and checks everything on that one compiled step.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import stepforge.fused as sf
from stepforge.fused import ops as _ops
from stepforge.fused._step import compiled as _compiled_step
from stepforge.testing.compiled import (
    compiled_beside_eager,
    lambda_schedule,
    same_bits,
    set_grads,
    state_tensors,
)

SHAPES = [(33, 7), (100,), (5, 5, 3)]

CASES = {
    "FusedAdam": (sf.FusedAdam, dict(weight_decay=0.01)),
    "CPUAdam": (sf.CPUAdam, dict(weight_decay=0.01, adamw_mode=False)),
    "HybridAdam": (sf.HybridAdam, dict(weight_decay=0.01)),
    "FusedLAMB": (sf.FusedLAMB, dict(weight_decay=0.01, max_grad_norm=1.0)),
    "FusedSGD": (sf.FusedSGD, dict(momentum=0.9, dampening=0.1, weight_decay=1e-4)),
}


def make_params(dtype=torch.float32, shapes=SHAPES):
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def assert_same_state(eager, compiled, eager_params, compiled_params, when):
    for i, (a, b) in enumerate(zip(eager_params, compiled_params, strict=True)):
        assert same_bits(a, b), f"{when}: param {i} differs (max |diff| {(a - b).abs().max().item():.3g})"
    mine, theirs = state_tensors(eager), state_tensors(compiled)
    assert [w for w, _ in mine] == [w for w, _ in theirs]
    for (where, a), (_, b) in zip(mine, theirs, strict=True):
        assert same_bits(a.reshape(-1), b.reshape(-1)), f"{when}: {where} differs"


@pytest.mark.parametrize("name", CASES)
def test_compiled_step_is_one_graph_compiled_once_with_the_eager_bits(name):
    """torch.compile(opt.step, fullgraph=True) while LambdaLR changes a tensor lr every step: no graph break, one
    graph for 20 steps (a recompile would raise), params and state equal to the eager step's bits at step 10 and
    20, and the compiled step's peak allocation within 1% of the eager step's."""
    cls, kw = CASES[name]
    eager_params, compiled_params = make_params(), make_params()
    eager = cls(eager_params, lr=torch.tensor(0.02), **kw)
    compiled = cls(compiled_params, lr=torch.tensor(0.02), **kw)
    with torch._dynamo.config.patch(error_on_recompile=True):  # one compile for all steps
        compiled_beside_eager(
            eager, compiled, eager_params, compiled_params,
            lambda label: assert_same_state(eager, compiled, eager_params, compiled_params, label),
        )  # fmt: skip
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 1
    assert float(compiled.param_groups[0]["lr"]) == pytest.approx(0.02 * 0.9**20)


def test_compiled_master_weight_step_skips_on_inf_and_reports_it():
    """bf16 params with fp32 masters: the compiled step checks the grads in the kernel, skips a step with an inf
    grad exactly as the eager step does (same bits, steps not advanced) and reports it in last_step_skipped /
    skipped_steps."""
    eager_params, compiled_params = make_params(torch.bfloat16), make_params(torch.bfloat16)
    eager = sf.FusedAdam(eager_params, lr=torch.tensor(0.01), master_weights=True)
    compiled = sf.FusedAdam(compiled_params, lr=torch.tensor(0.01), master_weights=True)
    step = torch.compile(compiled.step, fullgraph=True)
    for i in range(6):
        set_grads([eager_params, compiled_params], i)
        if i == 3:
            for p in (eager_params[1], compiled_params[1]):
                p.grad[5] = float("inf")
        eager.step()
        step()
        assert compiled.last_step_skipped == (i == 3)
        assert eager.last_step_skipped == (i == 3)
    assert compiled.skipped_steps == eager.skipped_steps == 1
    assert float(compiled.state[compiled_params[0]]["step"]) == 5.0
    assert_same_state(eager, compiled, eager_params, compiled_params, "after 6 steps")
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 1


def test_compiled_lamb_over_several_buckets_clips_and_skips_like_eager():
    """FusedLAMB with an fp32 and a bf16 bucket: the global clip and the all-buckets inf pre-check run in the
    graph (one l2norm operator per bucket) and give the eager step's bits, a step with a NaN grad included."""

    def mixed():
        ps = make_params()
        return ps + [torch.nn.Parameter(p.detach().to(torch.bfloat16)) for p in make_params(shapes=[(9, 4)])]

    eager_params, compiled_params = mixed(), mixed()
    kw = dict(lr=torch.tensor(0.01), max_grad_norm=0.5, skip_nonfinite=True)
    eager, compiled = sf.FusedLAMB(eager_params, **kw), sf.FusedLAMB(compiled_params, **kw)
    step = torch.compile(compiled.step, fullgraph=True)
    for i in range(5):
        set_grads([eager_params, compiled_params], i)
        for p in eager_params + compiled_params:
            p.grad.mul_(3.0)  # every step clips (norm above max_grad_norm)
        if i == 2:
            for p in (eager_params[3], compiled_params[3]):
                p.grad[0, 0] = float("nan")
        eager.step()
        step()
    assert eager.skipped_steps == compiled.skipped_steps == 1
    assert_same_state(eager, compiled, eager_params, compiled_params, "after 5 steps")
    assert counters["stats"]["unique_graphs"] == 1


def test_a_compiled_function_calling_step_and_the_tutorial_pattern():
    """The two documented patterns: (1) a fullgraph-compiled function that works on the grads and calls
    opt.step() (one graph holding both); (2) torch's compiled-optimizer-with-scheduler recipe, fn() { opt.step(); sched.step() } compiled
    without fullgraph: the only graph breaks are at the scheduler's skipped wrappers (torch's own AdamW breaks
    there too) and the step's frame compiles once over 10 steps."""
    eager_params, compiled_params = make_params(), make_params()
    eager = sf.CPUAdam(eager_params, lr=torch.tensor(0.01))
    compiled = sf.CPUAdam(compiled_params, lr=torch.tensor(0.01))

    @torch.compile(fullgraph=True)
    def train_step(scale):
        for p in compiled_params:
            p.grad.mul_(scale)
        compiled.step()

    for i in range(4):
        set_grads([eager_params, compiled_params], i)
        for p in eager_params:
            p.grad.mul_(0.5)
        eager.step()
        train_step(0.5)
    assert_same_state(eager, compiled, eager_params, compiled_params, "pattern 1")
    assert dict(counters["graph_break"]) == {}

    torch._dynamo.reset()
    counters.clear()
    sched_eager, sched_compiled = lambda_schedule([eager, compiled])

    @torch.compile
    def fn():
        compiled.step()
        sched_compiled.step()

    for i in range(10):
        set_grads([eager_params, compiled_params], 100 + i)
        eager.step()
        sched_eager.step()
        fn()
    assert_same_state(eager, compiled, eager_params, compiled_params, "pattern 2")
    assert counters["graph_break"], "the scheduler's wrappers are skipped by dynamo: expected breaks there"
    assert all("lr_scheduler.py" in reason for reason in counters["graph_break"]), dict(
        counters["graph_break"]
    )
    assert counters["stats"]["unique_graphs"] == 1


def test_eager_and_compiled_steps_interleave_on_one_optimizer():
    """Eager, compiled, eager steps on one optimizer (step tensors re-laid out in between) give the bits of an
    all-eager run: the compiled step takes the eager step's state and hands it back."""
    reference_params, mixed_params = make_params(), make_params()
    reference = sf.FusedAdam(reference_params, lr=0.01, weight_decay=0.1)
    mixed = sf.FusedAdam(mixed_params, lr=0.01, weight_decay=0.1)
    step = torch.compile(mixed.step, fullgraph=True)
    for i in range(9):
        set_grads([reference_params, mixed_params], i)
        reference.step()
        (step if 3 <= i < 6 else mixed.step)()
    assert_same_state(reference, mixed, reference_params, mixed_params, "after 9 steps")
    assert float(mixed.state[mixed_params[0]]["step"]) == 9.0


def test_float_lr_still_works_eagerly_and_compiled():
    """A float lr: eager steps as before, and a compiled step with it equals the eager one (the value is a
    constant of the graph, as for torch.optim)."""
    eager_params, compiled_params = make_params(), make_params()
    eager, compiled = (
        sf.FusedSGD(eager_params, lr=0.1, momentum=0.9),
        sf.FusedSGD(compiled_params, lr=0.1, momentum=0.9),
    )
    step = torch.compile(compiled.step, fullgraph=True)
    for i in range(3):
        set_grads([eager_params, compiled_params], i)
        eager.step()
        step()
    assert_same_state(eager, compiled, eager_params, compiled_params, "float lr")


def test_without_the_operators_the_step_runs_eagerly_with_one_warning(monkeypatch):
    """A torch without torch.library.register_fake (simulated): the compiled code calls the eager step (one graph
    break, one warning naming the reason), results unchanged; fullgraph=True refuses the break."""
    monkeypatch.setattr(_ops, "available", lambda: False)
    monkeypatch.setitem(_ops._status, "reason", "torch 2.3 has no torch.library.register_fake (simulated)")
    monkeypatch.setattr(_compiled_step, "_warned", set())
    monkeypatch.setattr(_compiled_step, "_fallback", [])  # made when the optimizers below are built
    eager_params, compiled_params = make_params(), make_params()
    eager, compiled = sf.FusedAdam(eager_params, lr=0.01), sf.FusedAdam(compiled_params, lr=0.01)
    step = torch.compile(compiled.step)
    with pytest.warns(
        RuntimeWarning, match=r"runs FusedAdam.step\(\) eagerly.*no torch.library.register_fake"
    ) as rec:
        for i in range(3):
            set_grads([eager_params, compiled_params], i)
            eager.step()
            step()
    assert len(rec) == 1
    assert_same_state(eager, compiled, eager_params, compiled_params, "fallback")
    assert sum(counters["graph_break"].values()) >= 1
    torch._dynamo.reset()  # else the cached non-fullgraph code of this frame would serve the next call
    with pytest.raises(torch._dynamo.exc.Unsupported, match="disable"):
        torch.compile(compiled.step, fullgraph=True)()


def test_gradscaler_state_is_refused_while_tracing_naming_the_fix():
    """GradScaler's grad_scale/found_inf (set by scaler.step around step()) are not compiled: dynamo's trace
    fails with the optimizer's message, which names the way out, and nothing was stepped."""
    params = make_params()
    opt = sf.FusedAdam(params, lr=0.01)
    set_grads([params], 0)
    before = [p.detach().clone() for p in params]
    opt.grad_scale = torch.tensor(2.0)
    with pytest.raises(Exception, match=r"does not take torch.amp.GradScaler.*scaler.unscale_\(optimizer\)"):
        torch.compile(opt.step, fullgraph=True)()
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
