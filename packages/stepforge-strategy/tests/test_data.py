# SPDX-License-Identifier: Apache-2.0
"""stepforge.strategy.data: ``StatefulDataLoader`` resumes mid-epoch; ``prepare_dataloader`` replays a shuffled
epoch exactly."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

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
    assert state == {"epoch": 1, "batches_yielded": 2}
    fresh = plugin.prepare_dataloader(data, batch_size=3, shuffle=True, seed=7)
    fresh.load_state_dict(state)
    rest = [b for (b,) in fresh]
    full_epoch1 = torch.cat(seen + rest)
    assert sorted(full_epoch1.tolist()) == list(range(20))
    assert not torch.equal(full_epoch1, full_epoch0)  # a new permutation per epoch
    replay = plugin.prepare_dataloader(data, batch_size=3, shuffle=True, seed=7)
    replay.load_state_dict({"epoch": 1, "batches_yielded": 0})
    assert torch.equal(torch.cat([b for (b,) in replay]), full_epoch1)
