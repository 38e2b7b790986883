# SPDX-License-Identifier: Apache-2.0
"""The simulation wrappers of ``stepforge.core.torch_compat`` on real torch objects: fake tensors take no memory,
MemTracker counts live bytes, the fake backend plays rank r of a large world, DDP's bucket assignment."""

from __future__ import annotations

import torch
import torch.distributed as dist

from stepforge.core import torch_compat as compat
from stepforge.testing.fake_world import run_isolated


def test_fake_tensors_have_shapes_but_no_memory() -> None:
    """A 4 GB tensor inside the fake mode costs nothing; real tensors are accepted as inputs."""
    with compat.fake_tensor_mode():
        big = torch.empty(1 << 30, dtype=torch.float32)
        mixed = big[:3] + torch.ones(3)
    assert type(big).__name__ == "FakeTensor" and big.numel() == 1 << 30
    assert tuple(mixed.shape) == (3,)


def test_memory_tracker_counts_live_bytes_and_the_peak() -> None:
    """Bytes allocated inside the tracker count while alive; the peak keeps the most at once."""
    tracker = compat.memory_tracker()
    with tracker:
        a = torch.empty(1000, dtype=torch.float32)
        b = torch.empty(500, dtype=torch.float64)
        del b
    current = compat.tracker_bytes(tracker)["cpu"]["Total"]
    peak = compat.tracker_bytes(tracker, "peak")["cpu"]["Total"]
    assert (current, peak) == (4000, 8000)
    del a


def test_module_peaks_are_each_modules_own() -> None:
    """The snapshot as a module's forward starts and at its forward peak holds what was alive then: the second of
    two linear layers sees the first's output beside its own; in backward each module's peak holds the gradients built by then,
    the first layer's more (backward reaches it last)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    tracker = compat.memory_tracker()
    tracker.track_external(model)
    with tracker:
        model(torch.randn(16, 64, requires_grad=True)).sum().backward()
    first, second = (compat.tracker_module_peaks(tracker, m) for m in model)
    assert set(first) == set(second) == {"entry", "forward", "backward"}
    # as each starts: the input (16 x 64 floats), then the input and the first layer's output
    assert (first["entry"]["Activation"], second["entry"]["Activation"]) == (16 * 64 * 4, 2 * 16 * 64 * 4)
    assert second["forward"]["Activation"] > first["forward"]["Activation"] > 0
    assert first["backward"]["Gradient"] > second["backward"]["Gradient"]
    # the first layer's backward peaks as it starts, beside the second layer's finished gradients
    assert first["backward"]["Gradient"] == sum(p.numel() * 4 for p in model[1].parameters())
    assert compat.tracker_module_peaks(tracker, torch.nn.Linear(1, 1)) == {}


def _fake_world_all_reduce() -> tuple[int, int, float]:
    compat.register_fake_backend()
    dist.init_process_group("fake", rank=5, world_size=1024, store=dist.HashStore())
    t = torch.full((4,), 3.0)
    dist.all_reduce(t)  # nothing is reduced: the local value stays
    out = (dist.get_rank(), dist.get_world_size(), float(t.sum()))
    dist.destroy_process_group()
    return out


def test_fake_backend_plays_one_rank_of_a_large_world() -> None:
    """One process is rank 5 of 1024; an all-reduce returns at once and keeps the local value."""
    assert run_isolated(_fake_world_all_reduce, timeout=120) == (5, 1024, 12.0)


def test_ddp_bucket_assignment_on_meta_tensors() -> None:
    """DDP's rule: the first bucket closes at 1 MiB, the others at the cap; small tensors share one bucket."""
    mib = [torch.empty(262144, device="meta") for _ in range(5)]  # 1 MiB each
    assert compat.ddp_bucket_assignment(mib, 2 * 1024**2) == [[0], [1, 2], [3, 4]]
    small = [torch.empty(100, device="meta") for _ in range(5)]
    assert compat.ddp_bucket_assignment(small, 25 * 1024**2) == [[0, 1, 2, 3, 4]]
    assert compat.ddp_bucket_assignment([], 1024) == []
