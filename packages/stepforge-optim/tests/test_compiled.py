# SPDX-License-Identifier: Apache-2.0
"""``torch.compile`` of Lamb's and Lars's step on the CPU: one graph without breaks, one compilation over 20
steps while an LR scheduler changes a tensor learning rate, the eager step's results within a stated bound,
and no extra copy of the state.

The bound: inductor fuses the element-wise passes and rounds each operation in float32 like the eager
``torch._foreach_*`` calls, except where ATen contracts a multiply-add (lerp, ``add`` with ``alpha``) and where
the eager CPU path sums per-tensor norms from cache-sized pieces; after 10 and 20 steps every parameter and state
tensor is within ``ULP_BOUND`` units of the last place of its own largest magnitude (measured: at most 2).
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from stepforge.optim import Lamb, Lars
from stepforge.testing.compiled import (
    compiled_beside_eager,
    lambda_schedule,
    peak_transient_bytes,
    resident_bytes,
    scale_ulps,
    set_grads,
)

ULP_BOUND = 4
SHAPES = [(33, 7), (100,), (5, 5, 3)]

CASES = {
    "Lamb": lambda ps: Lamb(
        ps, lr=torch.tensor(0.02), weight_decay=0.01, bias_correction=True, trust_clip=(0.1, 5)
    ),
    "Lamb.fused_lamb": lambda ps: Lamb.fused_lamb(ps, lr=torch.tensor(0.02), max_grad_norm=0.5),
    "Lars": lambda ps: Lars(
        ps,
        lr=torch.tensor(0.1),
        momentum=0.9,
        dampening=0.1,
        weight_decay=1e-3,
        exclude_from_adaptation=Lars.exclude_bias_and_norm,
    ),
}


def make_params(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def assert_close_in_ulps(eager, compiled, eager_params, compiled_params, when, bound=ULP_BOUND):
    for i, (a, b) in enumerate(zip(eager_params, compiled_params, strict=True)):
        assert scale_ulps(a, b) <= bound, f"{when}: param {i} is {scale_ulps(a, b)} ulps off"
    for i, (p, q) in enumerate(zip(eager_params, compiled_params, strict=True)):
        mine, theirs = eager.state[p], compiled.state[q]
        assert sorted(mine) == sorted(theirs)
        for key, a in mine.items():
            b = theirs[key]
            if key == "step":  # an int in the eager state, a tensor in the compiled one
                assert float(a) == float(b), f"{when}: param {i} step {float(a)} != {float(b)}"
            else:
                assert scale_ulps(a, b) <= bound, f"{when}: param {i} {key} is {scale_ulps(a, b)} ulps off"


@pytest.mark.parametrize("name", CASES)
def test_compiled_step_is_one_graph_compiled_once_and_matches_eager(name):
    """torch.compile(opt.step, fullgraph=True) while LambdaLR changes a tensor lr every step: no graph break, one
    graph for 20 steps (a recompile would raise), params and state within ULP_BOUND of the eager step at steps 10
    and 20, and the compiled step's peak allocation within 1% of the eager step's."""
    eager_params, compiled_params = make_params(), make_params()
    eager, compiled = CASES[name](eager_params), CASES[name](compiled_params)
    start = make_params()
    with torch._dynamo.config.patch(error_on_recompile=True):  # one compile for all steps
        compiled_beside_eager(
            eager, compiled, eager_params, compiled_params,
            lambda label: assert_close_in_ulps(eager, compiled, eager_params, compiled_params, label),
        )  # fmt: skip
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 1
    moved = [(a - b).abs().max().item() for a, b in zip(start, compiled_params, strict=True)]
    assert min(moved) > 1e-3  # the step did update every parameter


def test_a_fullgraph_function_calling_step_is_one_graph():
    """The second documented pattern: a function that works on the grads and calls opt.step(), compiled with
    fullgraph=True, is one graph and matches the eager step within the bound."""
    eager_params, compiled_params = make_params(), make_params()
    eager, compiled = CASES["Lars"](eager_params), CASES["Lars"](compiled_params)

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
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 1
    assert_close_in_ulps(eager, compiled, eager_params, compiled_params, "after 4 steps")


def test_compiled_lamb_keeps_no_update_buffer():
    """The compiled Lamb step recomputes the update u inside the norm and the update loops instead of holding it
    for the whole bucket: with tensors larger than the eager step's segments (which hold one tensor's u at a
    time) its peak allocation stays within 1% of the eager step's."""
    shapes = [(1_100_000,), (1_100_000,), (1_100_000,), (64, 64)]

    def make():
        gen = torch.Generator().manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.1) for s in shapes]
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen) * 1e-3
        return ps

    eager_params, compiled_params = make(), make()
    eager = Lamb(eager_params, lr=torch.tensor(1e-3), weight_decay=0.01)
    compiled = Lamb(compiled_params, lr=torch.tensor(1e-3), weight_decay=0.01)
    step = torch.compile(compiled.step, fullgraph=True)
    eager.step()
    step()
    resident = resident_bytes(compiled)
    eager_peak, compiled_peak = peak_transient_bytes(eager.step), peak_transient_bytes(step)
    assert eager_peak >= 4 * 1_100_000  # the eager step holds one large tensor's u (the comparison is fair)
    assert resident + compiled_peak <= 1.01 * (resident + eager_peak), (resident, eager_peak, compiled_peak)


def test_eager_steps_after_compiled_ones_continue_the_same_trajectory():
    """Compiled steps leave tensor steps in the state; a following eager step turns them back into ints and
    continues (bf16 params, fp32 state): the result stays within the bound of an all-eager run."""
    reference_params, mixed_params = make_params(torch.bfloat16), make_params(torch.bfloat16)
    reference = Lamb(reference_params, lr=0.01, weight_decay=0.01, bias_correction=True)
    mixed = Lamb(mixed_params, lr=0.01, weight_decay=0.01, bias_correction=True)
    step = torch.compile(mixed.step, fullgraph=True)
    for i in range(6):
        set_grads([reference_params, mixed_params], i)
        reference.step()
        (step if i < 3 else mixed.step)()
    assert mixed.state[mixed_params[0]]["step"] == 6
    assert_close_in_ulps(reference, mixed, reference_params, mixed_params, "after 6 steps")
    state = mixed.state_dict()
    assert state["state"][0]["exp_avg"].dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.parametrize("name", CASES)
def test_compiled_step_on_cuda_is_one_graph_and_matches_eager(name):
    """The same on CUDA tensors with a device tensor lr: one graph for 10 scheduled steps, no break, within
    ULP_BOUND of the eager step (``gpu`` marker: skips without a device)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA: torch.cuda.is_available() is False")
    eager_params = [torch.nn.Parameter(p.detach().cuda()) for p in make_params()]
    compiled_params = [torch.nn.Parameter(p.detach().cuda()) for p in make_params()]
    eager, compiled = CASES[name](eager_params), CASES[name](compiled_params)
    for opt in (eager, compiled):
        opt.param_groups[0]["lr"] = opt.param_groups[0]["lr"].cuda()
    step = torch.compile(compiled.step, fullgraph=True)
    schedulers = lambda_schedule([eager, compiled])
    compiled._opt_called = True
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i in range(10):
            set_grads([eager_params, compiled_params], i)
            eager.step()
            step()
            for s in schedulers:
                s.step()
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 1
    assert_close_in_ulps(eager, compiled, eager_params, compiled_params, "cuda, step 10")
