# SPDX-License-Identifier: Apache-2.0
"""The Booster on stepforge-core's contract (one process): plugins are core ``Plugin`` subclasses, every
``prepare`` returns a ``BoostedOptimizer``, ``Booster.backward`` is ``optimizer.backward``, precision adoption
goes through ``explicit_precision``/``set_precision``, and a plugin decides whether a mid-window save is refused.
"""

from __future__ import annotations

import ast
import inspect
import pathlib

import pytest
import torch
from _strategy_cases import make_model, make_strategy, prepare, train
from torch import nn

from stepforge import core
from stepforge.strategy import (
    Booster,
    GeminiPlugin,
    OptimizerWrapper,
    SinglePlugin,
    TorchDDPPlugin,
    TorchFSDPPlugin,
    checkpoint,
)


class _PlainPlugin(core.Plugin):
    """A third-party plugin without precision of its own: the Booster's mixed precision applies."""

    name = "plain"

    def prepare(self, model, optimizer=None, **kwargs):
        return model, optimizer  # already wrapped by the Booster's mixed precision


class _RawOptimizerPlugin(_PlainPlugin):
    name = "raw"

    def prepare(self, model, optimizer=None, **kwargs):
        return model, optimizer.unwrap()  # breaks the contract: a torch optimizer is not boosted


class _PrecisionPlugin(_PlainPlugin):
    name = "owns_precision"

    def __init__(self, precision=None):
        super().__init__(device="cpu", precision=precision, default_precision="fp32")

    def supported_precisions(self):
        return ["fp32", "bf16"]

    def control_precision(self):
        return True

    def prepare(self, model, optimizer=None, **kwargs):
        return model, OptimizerWrapper(optimizer)


class _RefusingPlugin(SinglePlugin):
    name = "refusing"

    def mid_window_save_refusal(self, optimizer):
        assert isinstance(optimizer, core.BoostedOptimizer)
        return "its gradients live on another planet"


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def test_every_strategy_plugin_is_a_core_plugin():
    for cls in (SinglePlugin, TorchDDPPlugin, TorchFSDPPlugin, GeminiPlugin):
        assert issubclass(cls, core.Plugin) and not inspect.isabstract(cls)
    fsdp, gemini = TorchFSDPPlugin(), GeminiPlugin(precision="bf16")
    assert fsdp.control_precision() and fsdp.precision == "fp32" and not fsdp.explicit_precision
    assert gemini.precision == "bf16" and gemini.explicit_precision and fsdp.builds_optimizer_config
    assert not SinglePlugin().control_precision() and SinglePlugin().precision is None


def test_a_plugin_with_only_name_and_prepare_trains_and_saves_through_the_booster(tmp_path):
    class Minimal(core.Plugin):
        name = "minimal"

        def prepare(self, model, optimizer=None, **kwargs):
            return model, optimizer  # already an OptimizerWrapper: the plugin does not control precision

    booster = Booster(plugin=Minimal())
    model = make_model(0)
    reference = make_model(0)
    model, opt, criterion, _, _ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.1), "crit")
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    assert isinstance(opt, OptimizerWrapper) and criterion == "crit" and booster.supports_no_sync()
    model.eval()
    reference.eval()
    x = torch.randn(4, 8)
    with booster.no_sync(model, opt):
        booster.backward(model(x).square().mean(), opt)
    opt.step()
    reference(x).square().mean().backward()
    ref_opt.step()
    for p, q in zip(model.unwrap().parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q)
    booster.save_model(model, str(tmp_path / "model.pt"))
    fresh = Booster(plugin=Minimal()).boost(make_model(1))[0]
    Booster(plugin=Minimal()).load_model(fresh, str(tmp_path / "model.pt"))
    for p, q in zip(fresh.unwrap().parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q)


# fp16 on CPU is what this tests: the one-time slowness note is expected
@pytest.mark.filterwarnings("ignore::stepforge.core.precision.SlowConfigurationWarning")
def test_backward_is_the_optimizers_backward_with_its_loss_scale():
    booster = Booster(mixed_precision=dict(type="fp16", init_scale=1024.0), plugin=_PlainPlugin(device="cpu"))
    model = make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, boosted, *_ = booster.boost(model, opt)
    assert isinstance(boosted, OptimizerWrapper) and isinstance(boosted, core.BoostedOptimizer)
    assert boosted.unwrap() is opt and boosted.loss_scale == 1024.0
    model.eval()  # no dropout: the two backward passes see the same graph
    x = torch.randn(4, 8)
    booster.backward(model(x).float().square().mean(), boosted)
    through_booster = _grads(model)
    boosted.zero_grad()
    (model(x).float().square().mean() * 1024.0).backward()  # what the fp16 loss scale must do, by hand
    by_hand = _grads(model)
    unscaled = [g / 1024.0 for g in by_hand]  # a power of two: exact
    assert all(torch.equal(a, b) for a, b in zip(through_booster, by_hand, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(by_hand, unscaled, strict=True))
    boosted.unscale_()
    assert all(torch.equal(a, b) for a, b in zip(_grads(model), unscaled, strict=True))
    with pytest.raises(TypeError, match="BoostedOptimizer"):
        booster.backward(model(x).sum(), opt)
    with pytest.raises(TypeError, match="BoostedOptimizer"):
        booster.clip_grad_norm_(opt, 1.0)


def test_a_plugin_whose_prepare_breaks_the_contract_is_named():
    booster = Booster(plugin=_RawOptimizerPlugin(device="cpu"))
    model = make_model(0)
    with pytest.raises(TypeError, match=r"plugin 'raw' returned a SGD.*stepforge.core.BoostedOptimizer"):
        booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_precision_adoption_goes_through_explicit_precision():
    adopted = Booster(mixed_precision="bf16", plugin=_PrecisionPlugin())
    assert adopted.plugin.precision == "bf16" and adopted.mixed_precision is None
    kept = Booster(mixed_precision="bf16", plugin=_PrecisionPlugin(precision="bf16"))
    assert kept.plugin.precision == "bf16"
    with pytest.raises(ValueError, match=r"mixed_precision='fp32' conflicts with the precision 'bf16'"):
        Booster(mixed_precision="fp32", plugin=_PrecisionPlugin(precision="bf16"))
    with pytest.raises(ValueError, match=r"'owns_precision' applies precision itself and takes fp32/bf16"):
        Booster(mixed_precision="fp16", plugin=_PrecisionPlugin())


def test_optimizer_wrapper_refuses_what_it_cannot_wrap():
    model = make_model(0)
    wrapped = OptimizerWrapper(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TypeError, match="already boosted"):
        OptimizerWrapper(wrapped)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        OptimizerWrapper(object())
    assert wrapped.scaler_state_dict() is None and Booster.unwrap_optimizer(wrapped) is wrapped.unwrap()


def test_the_plugin_decides_whether_a_mid_window_save_is_refused(tmp_path):
    refusing = make_strategy(str(tmp_path), plugin=_RefusingPlugin(device="cpu"))
    prepare(refusing)
    train(refusing, 0, 1, 0)  # 1 of 3 micro-batches: inside a window
    with pytest.raises(ValueError, match="cannot save them: its gradients live on another planet"):
        refusing.save_checkpoint("mid")
    train(refusing, 1, 3, 0)  # the window is closed: nothing to refuse
    assert refusing.save_checkpoint("boundary").endswith("boundary")
    refusing.close()


def test_checkpoint_code_does_not_import_the_strategy():
    folder = pathlib.Path(checkpoint.__file__).parent
    for source in sorted(folder.glob("*.py")):
        tree = ast.parse(source.read_text(encoding="utf-8"))
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert "strategy" not in imported and not any(m and m.endswith(".strategy") for m in imported), source
    assert {"model", "optim_wrapper", "plugin"} <= set(checkpoint.RunState.__dataclass_fields__)
