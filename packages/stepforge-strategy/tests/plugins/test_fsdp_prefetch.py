# SPDX-License-Identifier: Apache-2.0
"""torch_fsdp's FSDP1 prefetch arguments mapped onto FSDP2 explicit prefetching (2 gloo processes).

FSDP2 keeps its prefetch lists in private state, so the settings are checked by what they do: every all-gather
is recorded (``torch.distributed.all_gather_single``, which FSDP2's default all-gather calls, is wrapped) between
markers of each block's computation (a forward pre-hook and a backward pre-hook on the block's first layer,
which run after FSDP2 has gathered that block). Every unit has a different shard size, so the size names the
unit. Prefetching ``n`` blocks in forward means block ``i+1..i+n`` are gathered before block ``i`` computes; in
backward, blocks ``i-1..i-n`` before block ``i``'s gradient. Training with prefetching must give bitwise the
same losses and parameters as without (fp32): prefetching moves the same bytes earlier, no arithmetic changes.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from stepforge.strategy import Booster, TorchFSDPPlugin
from stepforge.testing.distributed import requires_gloo, run_distributed

WORLD, D = 2, 4
HIDDEN = (2, 4, 6, 8)  # even sizes: no padding, so a unit's all-gather input is exactly half its numel


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, hidden)
        self.fc2 = nn.Linear(hidden, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Stack(nn.Module):
    """Root parameters (``inp``, ``head``) around four blocks of different sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.blocks = nn.ModuleList(Block(h) for h in HIDDEN)
        self.head = nn.Linear(D, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(x)
        return out


def _unit_names(model: Stack) -> dict[int, str]:
    """Per-rank all-gather input numel -> unit name ("root", "b0".."b3")."""
    sizes = {sum(p.numel() for p in b.parameters()) // WORLD: f"b{i}" for i, b in enumerate(model.blocks)}
    root = sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in model.blocks.parameters())
    sizes[root // WORLD] = "root"
    assert len(sizes) == len(HIDDEN) + 1  # every unit is recognisable by its size
    return sizes


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, D, generator=g), torch.randn(8, 2, generator=g)


def _train(plugin_kwargs: dict, rank: int) -> tuple[list[float], dict, list[str]]:
    """Boost a fresh seeded Stack, train 3 steps; returns losses, full params and the last step's event log."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    torch.manual_seed(0)
    model = Stack()
    names = _unit_names(model)
    events: list[str] = []
    model.inp.register_forward_pre_hook(lambda *_: events.append("R"))  # the root's first computation
    for i, block in enumerate(model.blocks):
        block.fc1.register_forward_pre_hook(lambda *_, i=i: events.append(f"F{i}"))
        block.fc1.register_full_backward_pre_hook(lambda *_, i=i: events.append(f"B{i}"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    booster = Booster(plugin=TorchFSDPPlugin(**plugin_kwargs))
    model, opt, *_ = booster.boost(model, opt)
    real = dist.all_gather_single

    def recording(output_tensor, input_tensor, *args, **kwargs):  # type: ignore[no-untyped-def]
        events.append(names.get(input_tensor.numel(), f"?{input_tensor.numel()}"))
        return real(output_tensor, input_tensor, *args, **kwargs)

    losses = []
    dist.all_gather_single = recording
    try:
        for step in range(3):
            events.clear()
            x, y = _batch(step, rank)
            loss = F.mse_loss(model(x), y)
            events.append("|")  # forward / backward boundary
            booster.backward(loss, opt)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    finally:
        dist.all_gather_single = real
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    params = {k: v.detach().clone() for k, v in get_model_state_dict(model, options=options).items()}
    return losses, params, list(events)


SETTINGS = {
    "default": {},
    "forward1": {"forward_prefetch": True},
    "forward2_pre2": {"forward_prefetch": True, "backward_prefetch": "BACKWARD_PRE", "prefetch_blocks": 2},
    "post_enum": {"backward_prefetch": "BACKWARD_POST"},
    "backward_off": {"backward_prefetch": None},
    "blocks3": {"prefetch_blocks": 3},
    "no_reshard": {"reshard_after_forward": False, "forward_prefetch": True},
}


def _cases(rank: int, world: int) -> dict:
    from torch.distributed.fsdp import BackwardPrefetch

    settings = dict(SETTINGS)
    settings["post_enum"] = {"backward_prefetch": BackwardPrefetch.BACKWARD_POST}
    return {name: _train(kwargs, rank) for name, kwargs in settings.items()}


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_cases, WORLD, timeout=240)


def _split(events: list[str]) -> tuple[list[str], list[str]]:
    cut = events.index("|")
    return events[:cut], events[cut + 1 :]


def _ahead(events: list[str], marker: str, gathered: str) -> bool:
    """Whether ``gathered``'s all-gather comes before ``marker`` (the block's compute starting)."""
    return events.index(gathered) < events.index(marker)


N = len(HIDDEN)


@requires_gloo
@pytest.mark.parametrize("name", list(SETTINGS))
def test_prefetch_is_exact_and_gathers_each_unit_once(runs, name):
    for rank_out in runs:
        losses, params, events = rank_out[name]
        if (
            name != "default"
        ):  # bitwise against the run without any setting: prefetching changes no arithmetic
            assert losses == rank_out["default"][0]
            assert params.keys() == rank_out["default"][1].keys()
            for key, value in rank_out["default"][1].items():
                assert torch.equal(params[key], value), (name, key)
        forward, backward = _split(events)
        assert sorted(e for e in forward if e[0] not in "FR") == sorted(
            ["root"] + [f"b{i}" for i in range(N)]
        )
        gathered_back = sorted(e for e in backward if not e.startswith("B"))
        expected_back = [] if name == "no_reshard" else sorted(f"b{i}" for i in range(N))
        assert gathered_back == expected_back, (name, events)
    ref_losses = runs[0]["default"][0]
    assert len(ref_losses) == 3 and ref_losses[0] != ref_losses[-1]  # it trained


def _gathered_ahead(events: list[str]) -> tuple[list[int], list[int]]:
    """Per block, how many following blocks are gathered before it computes in forward, and how many preceding
    blocks before its gradient in backward (nearest first, checked)."""
    forward, backward = _split(events)
    fwd, bwd = [], []
    for i in range(N):
        ahead = [j for j in range(i + 1, N) if _ahead(forward, f"F{i}", f"b{j}")]
        assert ahead == list(range(i + 1, i + 1 + len(ahead))), events  # nearest blocks first
        fwd.append(len(ahead))
        behind = [j for j in range(i - 1, -1, -1) if _ahead(backward, f"B{i}", f"b{j}")]
        assert behind == list(range(i - 1, i - 1 - len(behind), -1)), events
        bwd.append(len(behind))
    return fwd, bwd


@requires_gloo
@pytest.mark.parametrize(
    ("name", "forward", "backward"),
    [
        ("default", 0, 1),  # FSDP2's own: nothing explicit in forward, the previous block in backward
        ("forward1", 1, 1),
        ("forward2_pre2", 2, 2),
        ("post_enum", 0, 1),  # BACKWARD_POST: FSDP2's one backward prefetch point, one block
        ("backward_off", 0, 0),
        ("blocks3", 0, 3),  # prefetch_blocks alone: backward only (forward_prefetch stays FSDP1's False)
    ],
)
def test_prefetch_settings_are_applied(runs, name, forward, backward):
    expected_forward = [min(forward, N - 1 - i) for i in range(N)]
    expected_backward = [min(backward, i) for i in range(N)]
    for rank_out in runs:
        events = rank_out[name][2]
        assert _gathered_ahead(events) == (expected_forward, expected_backward), events


@requires_gloo
def test_root_prefetches_first_blocks_in_forward(runs):
    forward, _ = _split(runs[0]["forward2_pre2"][2])
    # the root's all-gather, then the first two blocks, before the root computes; b0 then prefetches b2
    assert forward[:6] == ["root", "b0", "b1", "R", "b2", "F0"], forward
    forward, _ = _split(runs[0]["default"][2])
    assert forward[:3] == ["root", "R", "b0"], forward


def test_prefetch_arguments_map_and_refuse_by_name():
    from torch.distributed.fsdp import BackwardPrefetch

    assert (TorchFSDPPlugin().prefetch.forward, TorchFSDPPlugin().prefetch.backward) == (0, None)
    plan = TorchFSDPPlugin(forward_prefetch=True, backward_prefetch=BackwardPrefetch.BACKWARD_PRE).prefetch
    assert (plan.forward, plan.backward) == (1, 1)
    plan = TorchFSDPPlugin(
        forward_prefetch=True, backward_prefetch="BACKWARD_POST", prefetch_blocks=3
    ).prefetch
    assert (plan.forward, plan.backward) == (3, 3)
    assert TorchFSDPPlugin(backward_prefetch=None).prefetch.backward == 0
    for kwargs, error, match in (
        (dict(prefetch_blocks=0), ValueError, "prefetch_blocks must be an int >= 1"),
        (dict(prefetch_blocks=True), ValueError, "prefetch_blocks"),
        (dict(forward_prefetch="yes"), TypeError, "forward_prefetch must be a bool"),
        (dict(backward_prefetch="BACKWARD_SOON"), ValueError, "backward_prefetch must be"),
        (dict(limit_all_gathers=True), TypeError, "limit_all_gathers"),
        (dict(use_orig_params=True), TypeError, "use_orig_params"),
    ):
        with pytest.raises(error, match=match):
            TorchFSDPPlugin(**kwargs)
