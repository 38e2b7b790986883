# SPDX-License-Identifier: Apache-2.0
"""The optimizer a user already holds, wherever an optimizer is named: ``estimate(optimizer=opt)``,
``Booster(plugin="auto" | memory_budget=...).boost(model, opt)`` and ``stepforge-estimate --optimizer
package.module:factory``. For every torch.optim class and every stepforge optimizer the estimated state equals
the bytes the optimizer really holds after a real step; the instance is never rebuilt from its ``defaults`` nor
changed; an optimizer whose state cannot be read is named in a clear error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _optimizer_cases import READABLE, UNREADABLE, model

from stepforge.core import OptimizerStateError
from stepforge.strategy import Booster, estimate
from stepforge.strategy.memory import cli


def _held_state_bytes(optimizer: torch.optim.Optimizer, net: torch.nn.Module) -> int:
    """The bytes of every state tensor ``optimizer`` holds after a real step on ``net``."""
    net(torch.randn(4, 16)).square().mean().backward()
    optimizer.step()
    return sum(
        t.numel() * t.element_size()
        for state in optimizer.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor)
    )


def _state(est: dict | object) -> int:
    data = est if isinstance(est, dict) else est.to_dict()  # type: ignore[attr-defined]
    return data["device"]["optimizer_state"] + data["host"]["optimizer_state"]


@pytest.fixture(autouse=True)
def _importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # --optimizer _optimizer_cases:<name>


def test_every_optimizer_instance_is_estimated_as_it_really_holds(capsys: pytest.CaptureFixture[str]) -> None:
    """Per optimizer: the state ``estimate`` plans for the instance equals what the instance holds after a real
    step, before which the estimate left it as it was; ``Booster(plugin="auto")`` boosts it; the command line
    builds it from a factory and plans the same bytes."""
    for name, make in READABLE.items():
        net = model()
        optimizer = make(net.parameters())
        before = {id(p): dict(s) for p, s in optimizer.state.items()}
        est = estimate(net, "single", optimizer=optimizer, precision="fp32", device="cpu")
        assert {id(p): dict(s) for p, s in optimizer.state.items()} == before, name
        assert est.optimizer == type(optimizer).__name__
        assert cli.main(["_optimizer_cases:model", "--optimizer", f"_optimizer_cases:{name}", "--plugin",
                         "single", "--world-size", "1", "--precision", "fp32", "--device", "cpu",
                         "--format", "json"]) == 0  # fmt: skip
        (from_cli,) = json.loads(capsys.readouterr().out)
        held = _held_state_bytes(optimizer, net)
        assert (_state(est), _state(from_cli)) == (held, held), name

        boosted_net = model()
        booster = Booster(plugin="auto", memory_budget=dict(device="64MiB", host="64MiB"))
        booster.boost(boosted_net, make(boosted_net.parameters()))
        assert booster.plugin.name == "single", name


def test_adamw_with_a_default_its_constructor_refuses_is_boosted() -> None:
    """torch's AdamW keeps ``decoupled_weight_decay`` in ``defaults`` without taking it as an argument: the
    estimate never rebuilds the instance from its ``defaults`` (nor calls its constructor at all)."""
    calls = []

    class Counted(torch.optim.AdamW):
        def __init__(self, *args: object, **kwargs: object) -> None:
            calls.append(kwargs)
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    net = model()
    optimizer = Counted(net.parameters(), lr=1e-3)
    optimizer.defaults["not_an_argument"] = True  # what type(opt)(**opt.defaults) would trip on
    booster = Booster(plugin="auto", memory_budget=dict(device="64MiB"))
    booster.boost(net, optimizer)
    est = estimate(model(), "zero2", world_size=2, optimizer=optimizer, device="cpu")
    assert len(calls) == 1 and est.device["optimizer_state"] > 0


@pytest.mark.parametrize("name", sorted(UNREADABLE))
def test_an_optimizer_whose_state_cannot_be_read_is_named(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """LBFGS (its step needs a closure), SparseAdam (sparse gradients only) and Adafactor (factored moments
    sized by the shape, and a step that reads values, so it cannot run on meta tensors): a clear error naming
    the optimizer and why, from ``estimate``, at ``boost`` and (one line, exit status 2) on the command line."""
    make, reason = UNREADABLE[name]
    net = model()
    optimizer = make(net.parameters())
    label = type(optimizer).__name__
    with pytest.raises(OptimizerStateError, match=f"'{label}'.*{reason}"):
        estimate(net, "zero2", world_size=2, optimizer=optimizer, device="cpu")
    with pytest.raises(OptimizerStateError, match=f"'{label}'"):
        Booster(plugin="auto", memory_budget=dict(device="64MiB")).boost(net, optimizer)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["_optimizer_cases:model", "--optimizer", f"_optimizer_cases:{name}", "--plugin", "zero2"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and f"'{label}'" in err and reason in err


def test_auto_leaves_out_the_candidates_the_optimizer_cannot_step(caplog: pytest.LogCaptureFixture) -> None:
    """Muon steps matrices only, so ZeRO's flat shards cannot hold it: ``plugin="auto"`` leaves zero1/zero2 out
    (logged) and, when ``single`` does not fit either, fails with the budget error, not the optimizer's."""
    from stepforge.strategy import MemoryBudgetError

    net = model()
    booster = Booster(plugin="auto", memory_budget=dict(device=100, host=100))
    with caplog.at_level("INFO", logger="stepforge.strategy"), pytest.raises(MemoryBudgetError) as raised:
        booster.boost(net, READABLE["muon"](net.parameters()))
    assert "zero" not in str(raised.value) and "single" in str(raised.value)
    assert "plugin='auto' leaves out zero2: the optimizer 'Muon' cannot be stepped" in caplog.text
