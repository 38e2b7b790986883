# SPDX-License-Identifier: Apache-2.0
"""``compile=`` on one process: the option check, ``disable`` really skipping, ``target`` naming the method that
is compiled, a model already compiled by ``torch.compile`` refused only with ``compile=``, and Strategy's
``prepare``/``compile_model`` on the same path. (Every plugin against its eager run: compile/test_compiled_vs_eager.py.)"""

from __future__ import annotations

import logging

import pytest
import torch
from _compile_cases import CountingBackend, make_net
from _strategy_cases import make_strategy

from stepforge.strategy import Booster
from stepforge.strategy.compile import CompileConfig, compile_config, compile_model

X = torch.randn(4, 6)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch.compiler.reset()  # no compiled code of another test is reused (each counts its own graphs)
    yield
    torch.compiler.reset()


def test_compile_config_reads_mmengine_options_without_changing_the_callers_dict():
    assert compile_config(False, where="w") is None and compile_config(None, where="w") is None
    assert compile_config(True, where="w") == CompileConfig("forward", {})
    given = dict(target="train_step", mode="default", fullgraph=True, disable=False)
    assert compile_config(given, where="w") == CompileConfig(
        "train_step", {"mode": "default", "fullgraph": True}
    )
    assert given == dict(target="train_step", mode="default", fullgraph=True, disable=False)  # not popped
    assert compile_config(dict(disable=True, backend="eager"), where="w") is None


@pytest.mark.parametrize(
    "compile, error, match",
    [
        ("eager", TypeError, r"Booster.boost: compile must be True/False or a dict .* got str"),
        (dict(backnd="eager"), ValueError, r"unknown key\(s\) \['backnd'\]; allowed: .*'backend'.*'target'"),
        (dict(target=None), TypeError, r"compile\['target'\] must be a method name"),
        (dict(disable="yes"), TypeError, r"compile\['disable'\] must be True or False"),
    ],
)
def test_bad_compile_options_are_refused_where_they_enter(compile, error, match):
    with pytest.raises(error, match=match):
        Booster(plugin="single").boost(make_net(), compile=compile)


def _boost_and_step(compile) -> tuple[torch.nn.Module, torch.nn.Module]:
    net = make_net()
    model, optimizer, *_ = Booster(plugin="single").boost(
        net, torch.optim.SGD(net.parameters(), lr=0.1), compile=compile
    )
    optimizer.backward(model(X).square().mean())
    optimizer.step()
    return net, model


def test_disable_true_really_compiles_nothing_and_false_compiles():
    skipped = CountingBackend("eager")
    net, _ = _boost_and_step(dict(disable=True, backend=skipped))
    assert skipped.graphs == 0 and "forward" not in vars(net)  # the class's forward, untouched
    used = CountingBackend("eager")
    net, _ = _boost_and_step(dict(disable=False, backend=used))
    assert (used.graphs, used.runs) == (1, 1) and "forward" in vars(net)


def test_target_names_the_method_compiled_on_the_users_model():
    backend = CountingBackend("eager")
    net = make_net()
    model = Booster(plugin="single").boost(net, compile=dict(target="train_step", backend=backend))[0]
    eager = make_net()
    assert torch.equal(model(X), eager(X)) and backend.graphs == 0  # forward stays eager
    assert torch.equal(model.unwrap().train_step(X), eager.train_step(X))
    assert (backend.graphs, backend.runs) == (1, 1)
    assert list(net.state_dict()) == list(eager.state_dict())  # the module is not wrapped: same keys
    with pytest.raises(ValueError, match="compile target 'no_such' is not a method of Net"):
        Booster(plugin="single").boost(make_net(), compile=dict(target="no_such"))


def test_a_model_compiled_by_torch_compile_is_refused_only_with_compile():
    wrapped = torch.compile(make_net(), backend="eager")
    with pytest.raises(TypeError, match=r"already a torch.compile\(\) wrapper .* without compile="):
        Booster(plugin="single").boost(wrapped, compile=True)
    model = Booster(plugin="single").boost(wrapped)[0]  # as before: it trains (and saves without _orig_mod.)
    assert torch.equal(model(X), make_net()(X))


def test_strategy_prepare_compiles_through_the_booster_and_logs_it(tmp_path, caplog):
    backend = CountingBackend("eager")
    strategy = make_strategy(str(tmp_path))
    strategy.logger.propagate = True
    with caplog.at_level(logging.INFO, logger=strategy.logger.name):
        model, wrapper = strategy.prepare(
            make_net(), optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.1)), compile=dict(backend=backend)
        )
    assert "torch.compile(" in caplog.text and "'forward'" in caplog.text
    wrapper.update_params(model(X).square().mean())
    assert (backend.graphs, backend.runs) == (1, 1)
    off = CountingBackend("eager")
    other = make_strategy(str(tmp_path / "off")).prepare(make_net(), compile=dict(disable=True, backend=off))
    other(X)
    assert off.graphs == 0
    strategy.close()


def test_strategy_compile_model_is_mmengines_static_method():
    from stepforge.strategy import Strategy

    backend = CountingBackend("eager")
    net = make_net()
    assert Strategy.compile_model(net, dict(disable=True, backend=backend)) is net and "forward" not in vars(
        net
    )
    assert Strategy.compile_model(net, dict(backend=backend)) is net
    net(X)
    assert (backend.graphs, backend.runs) == (1, 1)
    assert compile_model(make_net(), False) == []
