# SPDX-License-Identifier: Apache-2.0
"""stepforge.strategy.data: ``StatefulDataLoader`` resumes mid-epoch; ``prepare_dataloader`` replays a shuffled
epoch exactly."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from stepforge.strategy import SinglePlugin, StatefulDataLoader


def test_stateful_dataloader_resumes_mid_epoch():
    data = TensorDataset(torch.arange(12.0))
    loader = StatefulDataLoader(DataLoader(data, batch_size=2))
    first = []
    for i, (b,) in enumerate(loader):
        first.append(b)
        if i == 2:
            break
    state = loader.state_dict()
    assert state == {"epoch": 0, "batches_yielded": 3}
    fresh = StatefulDataLoader(DataLoader(data, batch_size=2))
    fresh.load_state_dict(state)
    rest = [b for (b,) in fresh]
    assert torch.equal(torch.cat(first + rest), torch.arange(12.0))
    assert fresh.state_dict() == {"epoch": 1, "batches_yielded": 0}
    with pytest.raises(ValueError, match="batches_yielded"):
        fresh.load_state_dict({"epoch": 0})


def test_prepare_dataloader_resumes_a_shuffled_epoch_exactly():
    plugin = SinglePlugin()
    data = TensorDataset(torch.arange(20.0))
    loader = plugin.prepare_dataloader(data, batch_size=3, shuffle=True, seed=7)
    full_epoch0 = torch.cat([b for (b,) in loader])
    epoch1 = iter(loader)
    seen = [next(epoch1)[0] for _ in range(2)]
    state = loader.state_dict()
    assert state == {"epoch": 1, "batches_yielded": 2, "samples": 6}
    fresh = plugin.prepare_dataloader(data, batch_size=3, shuffle=True, seed=7)
    fresh.load_state_dict(state)
    rest = [b for (b,) in fresh]
    full_epoch1 = torch.cat(seen + rest)
    assert sorted(full_epoch1.tolist()) == list(range(20))
    assert not torch.equal(full_epoch1, full_epoch0)  # a new permutation per epoch
    replay = plugin.prepare_dataloader(data, batch_size=3, shuffle=True, seed=7)
    replay.load_state_dict({"epoch": 1, "batches_yielded": 0})
    assert torch.equal(torch.cat([b for (b,) in replay]), full_epoch1)


def _world(data, ranks: int, batch: int, drop_last: bool = False) -> list[StatefulDataLoader]:
    """One loader per rank of a ``ranks``-wide world, as ``prepare_dataloader`` builds them on each rank."""
    return [
        StatefulDataLoader(
            DataLoader(
                data,
                batch_size=batch,
                sampler=DistributedSampler(
                    data, num_replicas=ranks, rank=r, shuffle=True, seed=3, drop_last=drop_last
                ),
            )
        )
        for r in range(ranks)
    ]


def _order(n: int, epoch: int) -> list[int]:
    """DistributedSampler's documented epoch order: randperm(n) seeded with seed + epoch (seed=3)."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(3 + epoch)).tolist()


def _draw(world: list[StatefulDataLoader], steps: int, its: dict) -> list[list[int]]:
    """``steps`` lock-step iterations of every rank: the ids of each global micro-batch, rank 0 first."""
    out = []
    for _ in range(steps):
        ids = []
        for rank, loader in enumerate(world):
            if rank not in its:
                its[rank] = iter(loader)
            ids += next(its[rank])[0].long().tolist()
        out.append(ids)
    return out


@pytest.mark.parametrize("before,after", [(4, 3), (1, 2), (2, 4), (4, 2), (2, 1), (3, 3)])
def test_resume_at_another_world_size_continues_the_epoch_order(before, after):
    n, batch = 24, 1
    data = TensorDataset(torch.arange(float(n)))
    first = _world(data, before, batch)
    its: dict = {}
    steps = 12 // before  # half of epoch 0 (12 divides into 1, 2, 3 and 4 ranks alike)
    drawn = _draw(first, steps, its)
    state = first[0].state_dict()
    assert state == {"epoch": 0, "batches_yielded": steps, "samples": 12}
    second = _world(data, after, batch)
    for loader in second:
        loader.load_state_dict(state)
        assert loader.state_dict()["samples"] == state["samples"]
    its = {}
    rest = (n - state["samples"]) // (batch * after)
    drawn += _draw(second, rest, its)
    assert all(next(its[r], None) is None for r in range(after))  # the epoch ends there on every rank
    its = {}
    drawn += _draw(second, n // (batch * after), its)  # the whole next epoch, at the new size
    flat = [i for ids in drawn for i in ids]
    # explicit expectation: the epoch order, consumed in turn, with nothing repeated or skipped
    assert flat == _order(n, 0) + _order(n, 1)
    assert sorted(flat[:n]) == list(range(n))
    for r, loader in enumerate(second):  # the new epoch is the plain DistributedSampler's, rank by rank
        assert loader.state_dict() == {"epoch": 1, "batches_yielded": n // (batch * after), "samples": n}
        assert next(its[r], None) is None
        assert loader.state_dict() == {"epoch": 2, "batches_yielded": 0, "samples": 0}
        fresh = DistributedSampler(data, num_replicas=after, rank=r, shuffle=True, seed=3)
        fresh.set_epoch(2)
        assert torch.cat([b for (b,) in loader]).long().tolist() == list(fresh)


@pytest.mark.parametrize("drop_last", [False, True])
def test_a_share_that_does_not_divide_is_padded_or_cut_as_distributed_sampler(drop_last):
    n, batch = 26, 1
    data = TensorDataset(torch.arange(float(n)))
    for ranks in (1, 3, 4):  # from the epoch's start: exactly DistributedSampler's shares
        for r, loader in enumerate(_world(data, ranks, batch, drop_last)):
            loader.load_state_dict({"epoch": 0, "batches_yielded": 0, "samples": 0})
            want = DistributedSampler(
                data, num_replicas=ranks, rank=r, shuffle=True, seed=3, drop_last=drop_last
            )
            assert torch.cat([b for (b,) in loader]).long().tolist() == list(want)
    world = _world(data, 4, batch, drop_last)  # after 12 items at 4 ranks: 14 left for 4 ranks
    for loader in world:
        loader.load_state_dict({"epoch": 0, "batches_yielded": 3, "samples": 12})
    shares = [torch.cat([b for (b,) in loader]).long().tolist() for loader in world]
    order = _order(n, 0)
    rest = order[12:24] if drop_last else order[12:] + order[:2]  # cut to 12, or padded from the start
    assert shares == [rest[r::4] for r in range(4)]
