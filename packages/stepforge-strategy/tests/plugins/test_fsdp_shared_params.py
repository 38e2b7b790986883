# SPDX-License-Identifier: Apache-2.0
"""FSDP2 plugins keep tied parameters in one ``fully_shard`` unit.

A head tied to a block's weight (``head.weight = blocks[0].weight``, as tied embeddings are) used to fail under
``torch_fsdp`` and ``gemini`` with "mixed torch.Tensor and DTensor": the block was sharded on its own, so its
weight was resharded when the head read it. 2 gloo ranks, one spawn, bounded by its timeout. Reference: plain
torch on one process, each step on both ranks' rows (mean loss). Tolerance: fp32, only the reduction order
differs: rtol 1e-4, atol 1e-5 after 3 SGD steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stepforge.strategy import Booster
from stepforge.testing.distributed import requires_gloo, run_distributed

STEPS, ROWS = 3, 4


class _TiedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Linear(6, 6), nn.Linear(6, 6)])
        self.head = nn.Linear(6, 6, bias=False)
        self.head.weight = self.blocks[0].weight  # tied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


class _ParentReads(nn.Module):
    """The parent's forward reads a child's weight outside the child's forward: found by tracing the forward,
    so ``fc1`` stays in the root unit (no ``shard_modules=()`` needed)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(6, 6)
        self.fc2 = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(F.linear(torch.tanh(self.fc1(x)), self.fc1.weight)))


class _ParentReadsUntraceable(_ParentReads):
    """The same read behind data-dependent control flow: ``torch.fx`` cannot trace it, so the first forward is
    watched and the read raises an error naming the parameter and the fix."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool(x.sum() > -1e9):  # data-dependent: defeats symbolic tracing
            return super().forward(x)
        return x


class _UntraceableClean(_TiedNet):
    """Data-dependent control flow but no read outside a block: the watched first forward must not object."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) if bool(x.sum() > -1e9) else x


def _batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(world * ROWS, 6, generator=g), torch.randn(world * ROWS, 6, generator=g)


def _train(rank: int, world: int, plugin: dict, net: type[nn.Module] = _TiedNet) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    booster = Booster(plugin=plugin)
    model = net()
    model, opt, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for step in range(STEPS):
        x, y = _batch(step, world)
        rows = slice(rank * ROWS, (rank + 1) * ROWS)
        opt.zero_grad()
        booster.backward(F.mse_loss(model(x[rows]), y[rows]), opt)
        opt.step()
    full = get_model_state_dict(
        model.unwrap(), options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    return {k: v.detach().clone() for k, v in full.items()}


def _cases(rank: int, world: int) -> dict:
    return {
        "torch_fsdp": _train(rank, world, dict(type="torch_fsdp", precision="fp32")),
        "gemini": _train(rank, world, dict(type="gemini", precision="fp32", placement_policy="auto")),
        "parent_reads": _train(rank, world, dict(type="torch_fsdp", precision="fp32"), _ParentReads),
        "parent_reads_gemini": _train(rank, world, dict(type="gemini", precision="fp32"), _ParentReads),
        "untraceable_workaround": _train(
            rank, world, dict(type="torch_fsdp", precision="fp32", shard_modules=()), _ParentReadsUntraceable
        ),
        "untraceable_error": _first_forward_error(world),
        "untraceable_clean": _train(
            rank, world, dict(type="torch_fsdp", precision="fp32"), _UntraceableClean
        ),
    }


def _first_forward_error(world: int) -> str:
    booster = Booster(plugin=dict(type="torch_fsdp", precision="fp32"))
    model, *_ = booster.boost(_ParentReadsUntraceable())
    try:
        model(torch.randn(ROWS, 6))
    except RuntimeError as exc:
        message = str(exc)
    else:
        message = "no error"
    return message


def _reference(net: type[nn.Module]) -> nn.Module:
    ref = net()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(STEPS):
        x, y = _batch(step, 2)
        opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        opt.step()
    return ref


@requires_gloo
def test_tied_weights_train_under_fsdp_plugins_like_plain_torch():
    out = run_distributed(_cases, 2, timeout=180)[0]
    cases = (
        ("torch_fsdp", _TiedNet),
        ("gemini", _TiedNet),
        ("parent_reads", _ParentReads),
        ("parent_reads_gemini", _ParentReads),
        ("untraceable_workaround", _ParentReadsUntraceable),
        ("untraceable_clean", _UntraceableClean),
    )
    for name, net in cases:
        for key, value in _reference(net).state_dict().items():
            torch.testing.assert_close(out[name][key], value, rtol=1e-4, atol=1e-5, msg=f"{name}: {key}")
    assert "'fc1.weight' is read outside the forward" in out["untraceable_error"]
    assert "shard_modules=()" in out["untraceable_error"]
    for name in ("torch_fsdp", "gemini"):
        assert torch.equal(out[name]["head.weight"], out[name]["blocks.0.weight"]), name  # still one tensor


def test_tracing_finds_the_block_read_outside_its_forward():
    from stepforge.strategy.plugins._fsdp_common import blocks_read_outside

    net = _ParentReads()
    assert blocks_read_outside(net, [net.fc1, net.fc2]) == {id(net.fc1)}  # fc2 is only called
    tied = _TiedNet()
    assert (
        blocks_read_outside(tied, list(tied.blocks)) == set()
    )  # the head's read goes through its own forward
    untraceable = _ParentReadsUntraceable()
    assert blocks_read_outside(untraceable, [untraceable.fc1, untraceable.fc2]) is None


class _CountsItsForwards(torch.nn.Module):
    """A root whose forward updates its own state in place: a buffer and a Python counter."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 4)
        self.fc2 = torch.nn.Linear(4, 4)
        self.register_buffer("seen", torch.zeros(()))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.add_(1)
        self.calls += 1
        return self.fc2(self.fc1(x))


def test_tracing_leaves_the_model_as_it_was():
    from stepforge.strategy.plugins._fsdp_common import blocks_read_outside

    net = _CountsItsForwards()
    buffer = net.seen
    assert blocks_read_outside(net, [net.fc1, net.fc2]) == set()
    # the trace ran the forward's in-place updates on the real objects; preparing must not count a forward
    assert net.seen is buffer and net.seen.item() == 0.0
    assert net.calls == 0
    net(torch.ones(2, 4))
    assert net.seen.item() == 1.0 and net.calls == 1
