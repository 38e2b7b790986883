# SPDX-License-Identifier: Apache-2.0
"""Protocols and no_sync(): DDP-style, FSDP2-style, adapters, and objects with nothing to suspend."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from stepforge.core import (
    GradientHandler,
    GradientSyncSwitch,
    NoSyncModel,
    ShardedOptimizer,
    no_sync,
    register_no_sync_adapter,
    supports_no_sync,
)
from stepforge.core import sync as sync_module


class DDPLike:
    def __init__(self) -> None:
        self.syncing = True

    @contextmanager
    def no_sync(self):
        self.syncing = False
        try:
            yield
        finally:
            self.syncing = True


class FSDPLike:
    def __init__(self) -> None:
        self.requires_gradient_sync = True

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        self.requires_gradient_sync = requires_gradient_sync


def test_torch_classes_satisfy_the_protocols():
    assert issubclass(DistributedDataParallel, NoSyncModel)
    assert issubclass(FSDPModule, GradientSyncSwitch)
    assert not issubclass(torch.nn.Linear, NoSyncModel)
    # plain torch optimizers lack no_sync/clip_grad_norm_, so they are not sharded optimizers
    assert not isinstance(torch.optim.SGD([torch.zeros(1)], lr=0.1), ShardedOptimizer)


def test_no_sync_suspends_every_target_and_restores():
    ddp, fsdp, plain = DDPLike(), FSDPLike(), torch.nn.Linear(2, 2)
    assert supports_no_sync(ddp) and supports_no_sync(fsdp)
    assert not supports_no_sync(plain) and not supports_no_sync(None)
    with no_sync(ddp, None, fsdp, plain):
        assert not ddp.syncing and not fsdp.requires_gradient_sync
    assert ddp.syncing and fsdp.requires_gradient_sync


def test_no_sync_restores_on_error():
    fsdp = FSDPLike()
    with pytest.raises(RuntimeError, match="boom"), no_sync(fsdp):
        raise RuntimeError("boom")
    assert fsdp.requires_gradient_sync


def test_adapters_take_precedence(monkeypatch):
    monkeypatch.setattr(sync_module, "_ADAPTERS", [])
    seen = []

    class Custom:
        pass

    @contextmanager
    def adapter(target):
        seen.append("enter")
        yield
        seen.append("exit")

    register_no_sync_adapter(lambda t: isinstance(t, Custom), adapter)
    assert supports_no_sync(Custom())
    with no_sync(Custom()):
        assert seen == ["enter"]
    assert seen == ["enter", "exit"]


def test_other_protocols_are_structural():
    class Handler:
        def handle_gradient(self) -> None:
            pass

    assert isinstance(Handler(), GradientHandler)
    assert not isinstance(object(), GradientHandler)
