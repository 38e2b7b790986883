# SPDX-License-Identifier: Apache-2.0
"""The Plugin ABC: only ``name`` and ``prepare`` are a plugin's to write, the defaults of every other member
behave (one process and 2 gloo ranks)."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from torch import nn

from stepforge.core import BoostedOptimizer, HyperParameterError, Plugin, optimizer_list, unwrap_optimizer
from stepforge.core.plugin import default_device
from stepforge.testing.distributed import run_distributed


class _Plain(Plugin):
    """A plugin without precision of its own: the optimizer comes back wrapped by a minimal boosted wrapper."""

    name = "plain"

    def prepare(self, model, optimizer=None, **kwargs):
        model.to(self.device)
        return model, None if optimizer is None else _Boosted(optimizer)


class _WithPrecision(_Plain):
    name = "with_precision"

    def __init__(self, precision=None):
        super().__init__(precision=precision, default_precision="fp16")

    def supported_precisions(self):
        return ["fp32", "fp16", "bf16"]

    def control_precision(self):
        return True


class _Boosted:
    """The smallest complete BoostedOptimizer: loss.backward(), no scaler."""

    def __init__(self, optimizer):
        self.optim = optimizer
        self.param_groups = optimizer.param_groups

    def backward(self, loss):
        loss.backward()

    def backward_by_grad(self, tensor, grad):
        torch.autograd.backward(tensor, grad)

    def unscale_(self):
        pass

    def clip_grad_norm_(self, max_norm, norm_type=2.0):
        return nn.utils.clip_grad_norm_(
            [p for g in self.param_groups for p in g["params"]], max_norm, norm_type
        )

    def step(self, closure=None):
        return self.optim.step(closure)

    def zero_grad(self, set_to_none=True):
        self.optim.zero_grad(set_to_none)

    def state_dict(self):
        return self.optim.state_dict()

    def load_state_dict(self, state_dict):
        self.optim.load_state_dict(state_dict)

    def scaler_state_dict(self):
        return None

    def load_scaler_state_dict(self, state):
        pass

    def unwrap(self):
        return self.optim


def _model_and_optimizer(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


# -- the ABC ---------------------------------------------------------------------------------------------------
def test_an_incomplete_plugin_cannot_be_instantiated_and_the_error_names_the_member():
    class NoPrepare(Plugin):
        name = "no_prepare"

    class NoName(Plugin):
        def prepare(self, model, optimizer=None, **kwargs):
            return model, optimizer

    with pytest.raises(TypeError, match="prepare"):
        NoPrepare()
    with pytest.raises(TypeError, match="name"):
        NoName()
    with pytest.raises(TypeError, match="abstract"):
        Plugin()


def test_only_name_and_prepare_are_abstract_and_every_other_member_is_concrete():
    assert set(Plugin.__abstractmethods__) == {"name", "prepare"}
    colossalai = {"supported_devices", "supported_precisions", "control_precision", "control_device",
                  "support_no_sync", "configure", "no_sync", "control_checkpoint_io", "get_checkpoint_io",
                  "prepare_dataloader", "support_lora"}  # fmt: skip
    stepforge = {"device", "precision", "explicit_precision", "set_precision", "clip_grad_norm_", "max_norm",
                 "builds_optimizer_config", "get_state_dict", "set_state_dict", "supports_no_sync",
                 "world_size", "rank", "mid_window_save_refusal", "after_model_load", "bind_device"}  # fmt: skip
    for member in colossalai | stepforge:
        assert member in vars(Plugin), member

    class Minimal(Plugin):
        name = "minimal"

        def prepare(self, model, optimizer=None, **kwargs):
            return model, optimizer

    plugin = Minimal()  # instantiates with nothing else defined
    assert plugin.supports_no_sync() and plugin.support_no_sync() and plugin.get_checkpoint_io() is None
    assert plugin.mid_window_save_refusal(None) is None and plugin.device == default_device()


def test_a_plugin_whose_init_skips_the_base_init_still_answers():
    class NoSuperInit(Plugin):
        name = "no_super_init"

        def __init__(self, width):
            self.width = width

        def prepare(self, model, optimizer=None, **kwargs):
            return model, optimizer

    plugin = NoSuperInit(3)
    assert plugin.device == default_device() and plugin.precision is None and not plugin.explicit_precision
    assert plugin.world_size == 1 and plugin.rank == 0 and repr(plugin) == "NoSuperInit(precision=None)"


def test_a_structural_look_alike_is_not_a_plugin():
    class LooksLikeOne:
        name = "mini"

        def prepare(self, model, optimizer=None, **kwargs):
            return model, optimizer

        def no_sync(self, model, optimizer=None):
            return contextmanager(lambda: (yield))()

    assert not isinstance(LooksLikeOne(), Plugin)
    assert isinstance(_Plain(), Plugin)


# -- the defaults ---------------------------------------------------------------------------------------------
def test_plugin_base_defaults_on_one_process():
    plugin = _Plain(device="cpu")
    assert plugin.device == default_device() and plugin.world_size == 1 and plugin.rank == 0
    assert plugin.supported_devices() == ["cpu", "cuda"] and plugin.control_device()
    assert plugin.control_checkpoint_io() and plugin.supports_no_sync() and plugin.support_no_sync()
    assert not plugin.control_precision() and plugin.precision is None and not plugin.explicit_precision
    assert "fp8" in plugin.supported_precisions()  # the Booster's mixed precision applies
    assert plugin.max_norm == 0.0 and plugin.builds_optimizer_config is False
    with pytest.raises(HyperParameterError, match="does not apply precision"):
        plugin.set_precision("bf16")
    model, opt = _model_and_optimizer()
    m, o, crit, loader, sched = plugin.configure(model, opt, "crit", "loader", "sched")
    assert m is model and isinstance(o, BoostedOptimizer) and o.unwrap() is opt
    assert (crit, loader, sched) == ("crit", "loader", "sched")
    assert plugin.mid_window_save_refusal(o) is None
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert plugin.after_model_load(model, [o]) is None  # no masters: nothing to refresh, nothing changed
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_plugin_base_no_sync_suspends_a_no_sync_target_and_refuses_when_unsupported():
    calls = []

    class Target:
        @contextmanager
        def no_sync(self):
            calls.append("enter")
            yield
            calls.append("exit")

    plugin = _Plain()
    with plugin.no_sync(Target()):
        assert calls == ["enter"]
    assert calls == ["enter", "exit"]

    class NoSync(_Plain):
        def supports_no_sync(self):
            return False

    with pytest.raises(RuntimeError, match="'plain' does not support no_sync"):
        NoSync().no_sync(Target())
    assert NoSync().support_no_sync() is False


def test_precision_default_is_adopted_an_explicit_one_is_kept():
    default = _WithPrecision()
    assert default.precision == "fp16" and not default.explicit_precision
    default.set_precision("bf16")
    assert default.precision == "bf16"
    explicit = _WithPrecision(precision="fp32")
    assert explicit.precision == "fp32" and explicit.explicit_precision
    explicit.set_precision("fp32")  # the same value is no conflict
    with pytest.raises(HyperParameterError, match="set explicitly"):
        explicit.set_precision("bf16")
    with pytest.raises(
        HyperParameterError, match="precision must be one of 'fp32', 'fp16', 'bf16', got 'fp8'"
    ):
        _WithPrecision(precision="fp8")
    with pytest.raises(HyperParameterError, match="got 'int8'"):
        default.set_precision("int8")
    # any spelling the precision table knows is stored by its canonical name
    assert _WithPrecision(precision="BF16").precision == "bf16"
    assert _WithPrecision(precision=torch.float32).precision == "fp32"
    default.set_precision("no")  # the table's alias of fp32
    assert default.precision == "fp32"

    class Wrong(_Plain):
        def __init__(self):
            super().__init__(precision="bf16")

    with pytest.raises(HyperParameterError, match="pass mixed_precision to the Booster"):
        Wrong()


def test_clip_grad_norm_clips_the_global_norm_of_the_unwrapped_optimizer():
    plugin = _Plain()
    model, opt = _model_and_optimizer()
    model(torch.randn(5, 4)).square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    norm = plugin.clip_grad_norm_(model, _Boosted(opt), max_norm=0.5)
    torch.testing.assert_close(norm, expected)
    scale = 0.5 / (expected + 1e-6)
    for p, g in zip(model.parameters(), grads, strict=True):
        torch.testing.assert_close(p.grad, g * scale)
    fresh, fresh_opt = _model_and_optimizer()
    assert plugin.clip_grad_norm_(fresh, fresh_opt, 1.0).item() == 0.0  # no gradients yet


def test_state_dict_pair_round_trips_through_a_boosted_optimizer():
    plugin = _Plain()
    model, opt = _model_and_optimizer(0)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    msd, osd = plugin.get_state_dict(model, _Boosted(opt))
    other, other_opt = _model_and_optimizer(1)
    plugin.set_state_dict(other, [_Boosted(other_opt)], msd, osd)
    for p, q in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["exp_avg"], other_opt.state[q]["exp_avg"])
    assert optimizer_list(None) == [] and unwrap_optimizer(opt) is opt
    with pytest.raises(TypeError, match="optimizers must be"):
        optimizer_list(3)


def _sharded_loader(rank: int, world_size: int) -> tuple[int, int, list[float]]:
    plugin = _Plain(device="cpu")
    loader = plugin.prepare_dataloader(list(range(10)), batch_size=2, shuffle=True, seed=3)
    return plugin.rank, plugin.world_size, [float(x) for batch in loader for x in batch]


def test_prepare_dataloader_gives_each_rank_a_disjoint_share():
    results = run_distributed(_sharded_loader, 2, timeout=120)
    assert [(r, w) for r, w, _ in results] == [(0, 2), (1, 2)]
    shares = [set(items) for _, _, items in results]
    assert len(shares[0]) == len(shares[1]) == 5 and shares[0].isdisjoint(shares[1])
    assert shares[0] | shares[1] == {float(i) for i in range(10)}
    _, _, alone = _sharded_loader(0, 1)
    assert sorted(alone) == [float(i) for i in range(10)]


# -- the BoostedOptimizer protocol --------------------------------------------------------------------------
def test_boosted_optimizer_protocol_is_structural_and_complete():
    _, opt = _model_and_optimizer()
    assert isinstance(_Boosted(opt), BoostedOptimizer)
    assert not isinstance(opt, BoostedOptimizer)  # a torch optimizer has no backward/unwrap

    class NoUnwrap(_Boosted):
        unwrap = None  # type: ignore[assignment]

    class NoScalerState(_Boosted):
        scaler_state_dict = None  # type: ignore[assignment]

    assert not isinstance(NoUnwrap(opt), BoostedOptimizer)
    assert not isinstance(NoScalerState(opt), BoostedOptimizer)


def test_state_dict_pair_never_steps_a_fresh_optimizer():
    """torch's get/set_state_dict give a never-stepped optimizer state by a zero-lr step (Adam's step count 1
    before any real step); Plugin's pair must leave it fresh and save no state for it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    plugin = _Plain()
    msd, osd = plugin.get_state_dict(model, opt)
    assert osd["state"] == {} and len(osd["param_groups"]) == 1 and not opt.state
    assert all(p.grad is None for p in model.parameters())  # the placeholder gradient is gone
    plugin.set_state_dict(model, opt, msd, osd)
    assert not opt.state and all(p.grad is None for p in model.parameters())
    # a stepped optimizer's state round-trips, and a fresh save loaded into it makes it fresh again
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    _, stepped = plugin.get_state_dict(model, opt)
    assert len(stepped["state"]) == 4 and all(float(s["step"]) == 1.0 for s in stepped["state"].values())
    plugin.set_state_dict(model, opt, msd, osd)
    assert not opt.state
