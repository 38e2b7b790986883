# SPDX-License-Identifier: Apache-2.0
"""A plugin written ColossalAI's way (a subclass of ``Plugin`` / ``DPPluginBase`` implementing ``configure``,
``control_checkpoint_io``, ``get_checkpoint_io``, ``no_sync``, ``supported_devices``, ``supported_precisions``,
``control_precision``, ``control_device`` and ``support_no_sync``) instantiates and works with the Booster.

- ColossalAI's ``test_dp_plugin_base.py`` scenario at 2 gloo ranks: a subclass whose methods do nothing gives
  each rank a different share of the dataset from ``prepare_dataloader``.
- A DDP plugin written that way trains through ``Booster.boost``/``no_sync``/``backward`` like plain torch on one
  process over the concatenated batch (SGD, fp32; rtol 1e-5, atol 1e-6: only the reduction order differs), the
  Booster uses its ``get_checkpoint_io()`` and returns what its ``configure`` returns.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import TensorDataset

from stepforge import core
from stepforge.strategy import Booster, GeneralCheckpointIO, OptimizerWrapper
from stepforge.strategy.plugins import DPPluginBase, Plugin
from stepforge.testing.distributed import requires_gloo, run_distributed


class DPPluginWrapper(DPPluginBase):
    """ColossalAI's abstract methods with empty bodies, as in its test: only ``prepare_dataloader`` is used."""

    def configure(self, model, optimizer=None, criterion=None, dataloader=None, lr_scheduler=None):
        pass

    def control_checkpoint_io(self):
        pass

    def control_device(self):
        pass

    def control_precision(self):
        pass

    def get_checkpoint_io(self):
        pass

    def support_no_sync(self):
        pass

    def supported_devices(self):
        pass

    def supported_precisions(self):
        pass

    def no_sync(self, model, optimizer=None):
        pass


class _Criterion:
    """What the plugin's ``configure`` makes of the criterion (the Booster must hand this back)."""

    def __init__(self, criterion) -> None:
        self.criterion = criterion

    def __call__(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.criterion(out, target)


class ColossalStyleDDP(DPPluginBase):
    """A data-parallel plugin as a ColossalAI user writes one (ColossalAI's TorchDDPPlugin in miniature)."""

    def __init__(self) -> None:
        super().__init__()
        self.checkpoint_io = GeneralCheckpointIO(self)

    def supported_devices(self) -> list[str]:
        return ["cpu", "cuda"]

    def supported_precisions(self) -> list[str]:
        return ["fp32"]

    def control_precision(self) -> bool:
        return False

    def control_device(self) -> bool:
        return False  # the Booster's Accelerator places the model

    def support_no_sync(self) -> bool:
        return True

    def control_checkpoint_io(self) -> bool:
        return True

    def get_checkpoint_io(self):
        return self.checkpoint_io

    def configure(self, model, optimizer=None, criterion=None, dataloader=None, lr_scheduler=None):
        model = DistributedDataParallel(model)
        if optimizer is not None and not isinstance(optimizer, OptimizerWrapper):
            optimizer = OptimizerWrapper(optimizer)
        return model, optimizer, _Criterion(criterion), dataloader, lr_scheduler

    def no_sync(self, model, optimizer=None) -> AbstractContextManager:
        return model.no_sync()


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1))


def _window(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 5, generator=g), torch.randn(8, 1, generator=g)


def _ranks(rank: int, world: int) -> dict:
    out: dict = {}
    # ColossalAI's scenario: the plugin instantiates and shards the data by rank
    wrapper = DPPluginWrapper()
    out["facts"] = (wrapper.name, wrapper.rank, wrapper.world_size)
    loader = wrapper.prepare_dataloader(TensorDataset(torch.arange(0, 10)), batch_size=2)
    batch = next(iter(loader))[0]
    from_rank_1 = batch.clone()
    dist.broadcast(from_rank_1, src=1)
    out["first_batch"], out["rank_1_first_batch"] = batch, from_rank_1
    out["share"] = sorted(int(x) for (b,) in loader for x in b)

    # a working ColossalAI-style plugin through the Booster: 2 steps, each 2 micro-batches, the first under no_sync
    plugin = ColossalStyleDDP()
    booster = Booster(plugin=plugin)
    net = _net()
    sgd = torch.optim.SGD(net.parameters(), lr=0.1)
    model, opt, criterion, _, _ = booster.boost(net, sgd, F.mse_loss)
    out["criterion_is_configures"] = isinstance(criterion, _Criterion) and criterion.criterion is F.mse_loss
    out["io_is_plugins"] = booster.checkpoint_io is plugin.checkpoint_io
    out["accelerator"] = None if booster.accelerator is None else str(booster.accelerator.device)
    for step in range(2):
        x, y = _window(step)
        for micro in range(2):
            rows = slice((rank * 2 + micro) * 2, (rank * 2 + micro + 1) * 2)
            sync = booster.no_sync(model, opt) if micro == 0 else nullcontext()
            with sync:
                booster.backward(criterion(model(x[rows]), y[rows]) / 2, opt)
        opt.step()
        opt.zero_grad()
    out["params"] = [p.detach().clone() for p in model.unwrap().parameters()]
    return out


def _reference() -> list[torch.Tensor]:
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(2):
        x, y = _window(step)
        F.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in net.parameters()]


@requires_gloo
def test_colossalai_style_plugins_at_two_ranks():
    results = run_distributed(_ranks, 2, timeout=180)
    assert [r["facts"] for r in results] == [("DPPluginWrapper", 0, 2), ("DPPluginWrapper", 1, 2)]
    # as ColossalAI's test: rank 0's first batch differs from rank 1's
    assert not torch.equal(results[0]["first_batch"], results[0]["rank_1_first_batch"])
    assert torch.equal(results[0]["rank_1_first_batch"], results[1]["first_batch"])
    assert sorted(results[0]["share"] + results[1]["share"]) == list(range(10))
    assert set(results[0]["share"]).isdisjoint(results[1]["share"])
    ref = _reference()
    for out in results:
        assert out["criterion_is_configures"] and out["io_is_plugins"] and out["accelerator"] == "cpu"
        for p, q in zip(out["params"], ref, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert not torch.equal(ref[0], _net()[0].weight)  # training moved the weights


class _OneProcess(Plugin):
    """ColossalAI's ``Plugin`` (not data-parallel), with ``precision`` assigned as ColossalAI's plugins do."""

    def __init__(self, precision: str = "fp32", checkpoint_io=None) -> None:
        self.precision = precision
        self._io = checkpoint_io

    def supported_devices(self):
        return ["cpu"]

    def supported_precisions(self):
        return ["fp32", "bf16"]

    def control_precision(self):
        return True

    def control_device(self):
        return True

    def support_no_sync(self):
        return False

    def control_checkpoint_io(self):
        return self._io is not None

    def get_checkpoint_io(self):
        return self._io

    def configure(self, model, optimizer=None, criterion=None, dataloader=None, lr_scheduler=None):
        model = model.to(torch.bfloat16 if self.precision == "bf16" else torch.float32)
        return model, OptimizerWrapper(optimizer), criterion, dataloader, lr_scheduler

    def no_sync(self, model, optimizer=None):
        raise AssertionError("never called: support_no_sync() is False")

    def prepare_dataloader(self, dataset, batch_size, shuffle=False, seed=1024, drop_last=False,
                           pin_memory=False, num_workers=0, distributed_sampler_cls=None, **kwargs):  # fmt: skip
        return list(dataset)


def test_a_colossalai_style_plugin_on_one_process():
    plugin = _OneProcess(precision="bf16")
    assert isinstance(plugin, core.Plugin) and plugin.name == "_OneProcess"
    assert plugin.precision == "bf16" and plugin.explicit_precision
    assert not plugin.supports_no_sync() and plugin.prepare_dataloader([1, 2], 1) == [1, 2]
    booster = Booster(plugin=plugin)
    net = _net()
    model, opt, *_ = booster.boost(net, torch.optim.SGD(net.parameters(), lr=0.1))
    assert model.unwrap()[0].weight.dtype == torch.bfloat16 and opt.unwrap().param_groups[0]["lr"] == 0.1
    assert type(booster.checkpoint_io) is GeneralCheckpointIO  # control_checkpoint_io() is False
    with pytest.raises(RuntimeError, match="'_OneProcess' does not support no_sync"):
        booster.no_sync(model, opt)
    # prepare is configure's model and optimizer
    again = _OneProcess()
    prepared, boosted = again.prepare(_net(), torch.optim.SGD(_net().parameters(), lr=0.1))
    assert isinstance(boosted, OptimizerWrapper) and prepared[0].weight.dtype == torch.float32


def test_colossalai_style_plugins_are_checked_where_they_enter():
    # every ColossalAI method but configure
    members = {k: v for k, v in vars(_OneProcess).items() if k not in ("configure", "__init__", "__doc__")}
    NoConfigure = type("NoConfigure", (Plugin,), members)
    assert NoConfigure.__abstractmethods__ == frozenset({"configure"})
    with pytest.raises(TypeError, match="configure"):
        NoConfigure()
    with pytest.raises(RuntimeError, match="launch_from_torch"):
        DPPluginWrapper()  # no process group on this process
    with pytest.raises(TypeError, match="returned a dict from get_checkpoint_io"):
        Booster(plugin=_OneProcess(checkpoint_io={}))
