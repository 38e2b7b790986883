# SPDX-License-Identifier: Apache-2.0
"""``plugin="auto"`` and ``memory_budget``: the fastest plugin that fits is chosen at boost from the estimates
(device steps before host steps, then fewest bytes sent, then least optimizer work), the choice is logged with
the table; nothing fitting fails at boost before the model is touched, naming what would fit; an explicit plugin
over budget fails the same way. From the Booster, the Strategy (2 gloo ranks) and with the budget defaults."""

from __future__ import annotations

import logging
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stepforge.strategy import Booster, MemoryBudgetError, Strategy
from stepforge.strategy.memory import choose_plugin, memory_budget
from stepforge.strategy.memory._auto import MemoryBudget
from stepforge.strategy.memory.gpt import gpt
from stepforge.testing.distributed import requires_gloo, run_distributed

ADAMW = dict(type="AdamW", lr=1e-3)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))  # 0.53 M parameters


def test_auto_on_one_process_takes_single_when_it_fits(caplog: pytest.LogCaptureFixture) -> None:
    """One process, budget ample: ``single`` (no communication, steps on the device) is the fastest; the table
    and the reason are logged; the boosted model trains."""
    booster = Booster(plugin="auto", memory_budget=dict(device="1GiB", host="1GiB"))
    assert booster.plugin.name == "auto" and booster.plugin.device.type == "cpu"  # the device, before boost
    with caplog.at_level(logging.INFO, logger="stepforge.strategy"):
        model, optimizer, *_ = booster.boost(_mlp(), ADAMW)
    assert booster.plugin.name == "single"
    assert "plugin='auto' chose single" in caplog.text and "fits" in caplog.text
    booster.backward(model(torch.randn(4, 256)).square().mean(), optimizer)
    optimizer.step()


def test_nothing_fitting_fails_at_boost_before_touching_the_model() -> None:
    """A budget below every candidate: ``MemoryBudgetError`` with the table, raised before the model is moved or
    cast (its parameters untouched, still fp32)."""
    model = _mlp()
    before = [p.detach().clone() for p in model.parameters()]
    booster = Booster(
        plugin="auto", mixed_precision="bf16", memory_budget=dict(device=2_000_000, host=2_000_000)
    )
    with pytest.raises(
        MemoryBudgetError, match=r"no plugin fits the memory budget(.|\n)*  fits\n(.|\n)*  NO\n"
    ):
        booster.boost(model, ADAMW)
    assert all(
        torch.equal(a, b) and b.dtype == torch.float32
        for a, b in zip(before, model.parameters(), strict=True)
    )


def test_nothing_fitting_names_the_world_size_that_would() -> None:
    """Planning the 1.3 B GPT on 8 CUDA ranks with 3 GiB each: none of DDP, ZeRO-2 and FSDP2 fits; the error names
    the world size at which FSDP2 would, and it does fit there."""
    model = gpt("gpt-1.3b")
    common = dict(precision="bf16", optimizer=ADAMW, device=torch.device("cuda"), backend="nccl")
    budget = MemoryBudget(3 * 1024**3, 64 * 1024**3)
    with pytest.raises(MemoryBudgetError, match=r"Would fit: .*torch_fsdp at (\d+) ranks") as info:
        choose_plugin(
            model, world_size=8, budget=budget, candidates=("torch_ddp", "zero2", "torch_fsdp"), **common
        )
    world = int(re.search(r"torch_fsdp at (\d+) ranks", str(info.value)).group(1))  # type: ignore[union-attr]
    there = choose_plugin(model, world_size=world, budget=budget, candidates=("torch_fsdp",), **common)
    with pytest.raises(MemoryBudgetError):  # and at half that world it does not
        choose_plugin(model, world_size=world // 2, budget=budget, candidates=("torch_fsdp",), **common)
    assert there.plugin == "torch_fsdp"


def test_an_explicit_plugin_over_budget_fails_naming_one_that_fits() -> None:
    """``single`` with a budget it exceeds: the error gives its peak and the plugin ``auto`` would choose."""
    booster = Booster(plugin="single", memory_budget=dict(device="4MiB", host="4MiB"))
    with pytest.raises(MemoryBudgetError, match=r"plugin 'single' does not fit(.|\n)*[Ww]ould fit"):
        booster.boost(_mlp(), ADAMW)
    ok = Booster(plugin="single", memory_budget=dict(device="1GiB", host="1GiB"))
    ok.boost(_mlp(), ADAMW)
    assert ok.plugin.name == "single"


def test_the_order_device_steps_then_bytes_sent() -> None:
    """Planning a 64-rank CUDA run of the 1.3 B GPT in bf16 (64 GiB of host per rank): with 40 GiB of device
    memory every plugin fits and ``zero2`` sends the fewest bytes; with 4 GiB only FSDP2 and gemini fit and
    ``torch_fsdp`` (steps on the device) comes before gemini's offloading auto placement;
    with 1.4 GiB only the latter fits (estimated peaks 1.49 and 1.17 GiB)."""
    model = gpt("gpt-1.3b")
    common = dict(
        world_size=64, precision="bf16", optimizer=ADAMW, device=torch.device("cuda"), backend="nccl"
    )
    roomy = choose_plugin(model, budget=MemoryBudget(40 * 1024**3, 64 * 1024**3), **common)
    assert (roomy.plugin, roomy.settings) == ("zero2", {})
    assert all(roomy.fits)
    tight = choose_plugin(model, budget=MemoryBudget(4 * 1024**3, 64 * 1024**3), **common)
    fitting = {e.plugin + str(e.settings) for e, f in zip(tight.estimates, tight.fits, strict=True) if f}
    assert fitting == {"torch_fsdp{}", "gemini{'placement_policy': 'auto'}"}
    assert (tight.plugin, tight.settings) == ("torch_fsdp", {})
    tiny = choose_plugin(model, budget=MemoryBudget(int(1.4 * 1024**3), 64 * 1024**3), **common)
    assert (tiny.plugin, tiny.settings) == ("gemini", {"placement_policy": "auto"})


def test_budget_defaults_and_spellings() -> None:
    """Missing sizes are the free memory (positive); sizes as bytes or strings; unknown keys are named."""
    budget = memory_budget(dict(host="2GiB"), torch.device("cpu"))
    assert budget.host == 2 * 1024**3 and budget.device > 0
    assert memory_budget(dict(device=1000), torch.device("cpu")).device == 1000
    with pytest.raises(ValueError, match="'hots'"):
        memory_budget(dict(hots=1), torch.device("cpu"))
    with pytest.raises(ValueError, match="device"):
        memory_budget(dict(device=-5), torch.device("cpu"))


def _strategy_auto(rank: int, world: int, work_dir: str) -> tuple[str, float]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 8))
    # DDP's replicated state and buckets exceed 1 MB per rank; ZeRO-2's shards and buckets fit
    strategy = Strategy(
        plugin="auto", work_dir=work_dir, memory_budget=dict(device=1_000_000, host=1_000_000),
        log_kwargs=dict(console=False),
    )  # fmt: skip
    model, wrapper = strategy.prepare(model, optim_wrapper=dict(optimizer=ADAMW))
    x, y = torch.randn(4, 64), torch.randn(4, 8)
    wrapper.update_params(F.mse_loss(model(x), y))
    name = strategy.plugin_name
    strategy.close()
    return name, float(next(model.parameters()).detach().float().sum())


@requires_gloo
def test_strategy_with_auto_on_two_ranks(tmp_path) -> None:
    """``Strategy(plugin="auto", memory_budget=...)`` on 2 gloo ranks: ``prepare`` chooses the same plugin on
    both ranks (a sharding one: the replicated ones exceed the budget) and a step trains."""
    results = run_distributed(_strategy_auto, 2, str(tmp_path))
    names = {name for name, _ in results}
    assert len(names) == 1 and names.pop() in ("zero1", "zero2", "torch_fsdp")
    assert results[0][1] == pytest.approx(results[1][1])


def _window_budget() -> tuple[int, torch.Tensor]:
    """A CPU budget between ``single``'s peak with one micro-batch per step and with four (the window's
    gradients held beside a later micro-batch's activations), and the example batch."""
    from stepforge.strategy import estimate

    x = torch.randn(512, 256)
    common = dict(optimizer=ADAMW, inputs=x, device="cpu")
    one = estimate(_mlp, "single", **common).peak(None)  # type: ignore[arg-type]
    four = estimate(_mlp, "single", accumulation_steps=4, **common).peak(None)  # type: ignore[arg-type]
    assert four > one
    return (one + four) // 2, x


def test_accumulation_steps_in_the_budget_and_from_the_run() -> None:
    """``accumulation_steps`` comes from the budget or from ``boost`` (the run's own count); the two may agree
    but not differ; a count below 1 is named."""
    cpu = torch.device("cpu")
    assert memory_budget(dict(device=1), cpu).accumulation_steps == 1
    assert memory_budget(dict(accumulation_steps=3), cpu).accumulation_steps == 3
    assert memory_budget({}, cpu, accumulation_steps=4).accumulation_steps == 4
    assert memory_budget(dict(accumulation_steps=4), cpu, accumulation_steps=4).accumulation_steps == 4
    with pytest.raises(ValueError, match="accumulation_steps=2 contradicts the run's 4"):
        memory_budget(dict(accumulation_steps=2), cpu, accumulation_steps=4)
    with pytest.raises(ValueError, match="memory_budget: accumulation_steps must be an int >= 1"):
        memory_budget(dict(accumulation_steps=0), cpu)


def test_a_budget_that_fits_one_micro_batch_refuses_a_window_of_four() -> None:
    """``single`` under a budget between its peaks for one and for four micro-batches per step: ``boost`` passes
    without accumulation and raises :class:`MemoryBudgetError` naming the window with ``accumulation_steps=4``,
    from ``boost`` or from the budget."""
    limit, x = _window_budget()
    spec = dict(device=limit, host=limit, inputs=x)  # on a CPU device one memory: the smaller must fit
    Booster(plugin="single", memory_budget=spec).boost(_mlp(), ADAMW)
    with pytest.raises(MemoryBudgetError, match="4 micro-batches per step"):
        Booster(plugin="single", memory_budget=spec).boost(_mlp(), ADAMW, accumulation_steps=4)
    with pytest.raises(MemoryBudgetError, match="4 micro-batches per step"):
        Booster(plugin="single", memory_budget=dict(spec, accumulation_steps=4)).boost(_mlp(), ADAMW)


def test_strategy_passes_the_wrappers_accumulative_counts_to_the_budget(tmp_path) -> None:
    """``Strategy.prepare`` with ``accumulative_counts=4``: the budget is checked for a window of four
    micro-batches (refused); with ``accumulative_counts=1`` the same budget passes."""
    limit, x = _window_budget()
    for counts, fits in ((1, True), (4, False)):
        strategy = Strategy(
            plugin="single", work_dir=str(tmp_path / str(counts)), log_kwargs=dict(console=False),
            memory_budget=dict(device=limit, host=limit, inputs=x),
        )  # fmt: skip
        wrapper = dict(optimizer=ADAMW, accumulative_counts=counts)
        try:
            if fits:
                strategy.prepare(_mlp(), optim_wrapper=wrapper)
            else:
                with pytest.raises(MemoryBudgetError, match="4 micro-batches per step"):
                    strategy.prepare(_mlp(), optim_wrapper=wrapper)
        finally:
            strategy.close()
