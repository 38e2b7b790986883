# SPDX-License-Identifier: Apache-2.0
"""DDP and FSDP2 on 2 and 3 gloo processes: exactness against one process on the whole global batch, and the
number of gradient collectives per window (a DDP communication hook; wrapped FSDP2 reduce-scatters).

All checks of one world size run in one spawned group (spawning costs seconds). Each rank builds every rank's
data from a seed, so the single-process reference is computed in the same process.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from stepforge.accum import AccumulationWarning, OptimWrapper, accumulate_gradient
from stepforge.testing.accum_cases import big_batch_reference, mse, tiny_mlp
from stepforge.testing.distributed import requires_gloo, run_distributed

pytestmark = [pytest.mark.distributed, requires_gloo]

K = 3  # micro-batches per window
WINDOWS = 2


def _global_data(world: int, sizes: list[list[list[int]]], seed: int):
    """sizes[window][micro][rank] -> data[window][micro][rank] = (x, y)."""
    g = torch.Generator().manual_seed(seed)
    return [
        [
            [(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)) for n in micro]
            for micro in window
        ]
        for window in sizes
    ]


def _big_batch_of_all_ranks(data, lr=0.1):
    """One SGD(momentum) step per window on the concatenation of every micro-batch of every rank."""
    return big_batch_reference(
        [[pair for micro in window for pair in micro] for window in data], lr=lr, momentum=0.9
    )


def _check_close(model, ref, what):
    for p, r in zip(model.parameters(), ref, strict=True):
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        torch.testing.assert_close(full.detach(), r, atol=1e-6, rtol=1e-5, msg=lambda m: f"{what}: {m}")


def _count_hook(state: list, bucket):
    state.append(bucket.index())
    return default_hooks.allreduce_hook(None, bucket)


def _ddp(record: list) -> DDP:
    # a tiny bucket cap: several buckets, so "one all-reduce per bucket per window" is a real check
    model = DDP(tiny_mlp(), bucket_cap_mb=1e-5)
    model.register_comm_hook(record, _count_hook)
    return model


@contextlib.contextmanager
def _count_calls(name: str, calls: list):
    original = getattr(dist, name)

    def wrapped(*args, **kwargs):
        calls.append(name)
        return original(*args, **kwargs)

    setattr(dist, name, wrapped)
    try:
        yield
    finally:
        setattr(dist, name, original)


def _buckets_per_step(model: DDP, record: list) -> int:
    """All-reduces of one plain (unaccumulated) step, after DDP's first-iteration bucket rebuild."""
    x, y = torch.randn(2, 4), torch.randn(2, 1)
    for _ in range(2):
        record.clear()
        mse(model, x, y).backward()
    model.zero_grad(set_to_none=True)
    n = len(record)
    record.clear()
    return n


def _ddp_optim_wrapper(rank, world, data, weighted: bool, guard_forward: bool):
    record: list = []
    model = _ddp(record)
    buckets = _buckets_per_step(model, record)
    wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), accumulative_counts=K)
    per_window, weight_reduces = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", AccumulationWarning)
        for window in data:
            record.clear()
            calls: list = []
            with _count_calls("all_reduce", calls):
                for micro in window:
                    x, y = micro[rank]
                    n = len(x) if weighted else None
                    if guard_forward:
                        with wrapper.optim_context(model):
                            loss = mse(model, x, y)
                        wrapper.update_params(loss, num_items=n)
                    else:  # the classic misuse: only the backward inside the no-sync context
                        loss = mse(model, x, y)
                        with wrapper.optim_context(model):
                            wrapper.update_params(loss, num_items=n)
            per_window.append(sorted(record))
            # the hook's bucket all-reduces go through dist.all_reduce too: count only the others
            weight_reduces.append(len(calls) - len(record))
    messages = [str(w.message) for w in caught if issubclass(w.category, AccumulationWarning)]
    return model.module, buckets, per_window, weight_reduces, messages


def _fsdp2(rank, world, data, ref, shard_root: bool = True):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = tiny_mlp()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    if shard_root:  # otherwise a plain root holds the sharded blocks: the adapter must find them
        fully_shard(model, mesh=mesh)
    wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), accumulative_counts=K)
    per_window = []
    for window in data:
        calls: list = []
        with _count_calls("reduce_scatter_single", calls), _count_calls("reduce_scatter_tensor", calls):
            for micro in window:
                x, y = micro[rank]
                with wrapper.optim_context(model):
                    loss = mse(model, x, y)
                    wrapper.update_params(loss, num_items=len(x))
        per_window.append(len(calls))
    _check_close(model, ref, "FSDP2 weighted")
    # and without the context: every micro-batch reduce-scatters (what no_sync saves)
    calls = []
    with _count_calls("reduce_scatter_single", calls), _count_calls("reduce_scatter_tensor", calls):
        for micro in data[0]:
            x, y = micro[rank]
            wrapper.update_params(mse(model, x, y), num_items=len(x))
    return per_window, len(calls)


def _colossal_ddp(rank, world, data, ref):
    record: list = []
    model = _ddp(record)
    buckets = _buckets_per_step(model, record)
    batches = [micro[rank] for window in data for micro in window]
    optim, loader, _, _ = accumulate_gradient(
        model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), batches, K
    )
    per_window = []
    for i, (x, y) in enumerate(loader):
        if i % K == 0:
            record.clear()
        optim.zero_grad()
        with optim.optim_context():
            optim.backward(mse(model, x, y), weight=len(x))
        optim.step()
        if i % K == K - 1:
            per_window.append(len(record))
    _check_close(model.module, ref, "ColossalAI API DDP weighted")
    # misuse: ColossalAI's own pattern, forward outside and only the backward wrapped
    record.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", AccumulationWarning)
        for x, y in batches[:K]:
            optim.zero_grad()
            optim.backward(mse(model, x, y), weight=len(x))
            optim.step()
    msgs = [str(w.message) for w in caught if issubclass(w.category, AccumulationWarning)]
    return buckets, per_window, len(record), msgs


def _all_checks(rank: int, world: int) -> dict:
    out: dict = {}
    uniform = [[[2] * world for _ in range(K)] for _ in range(WINDOWS)]
    # uneven per micro-batch and per rank; one rank has an empty micro-batch weight-wise small
    uneven = [[[1 + (w + m + r) % 4 for r in range(world)] for m in range(K)] for w in range(WINDOWS)]
    data_u = _global_data(world, uniform, seed=11)
    data_n = _global_data(world, uneven, seed=12)
    ref_u, ref_n = _big_batch_of_all_ranks(data_u), _big_batch_of_all_ranks(data_n)

    # DDP, mmengine API: uniform (plain divisor) and uneven (weighted)
    model, buckets, per_window, reduces, msgs = _ddp_optim_wrapper(rank, world, data_u, False, True)
    _check_close(model, ref_u, "DDP uniform")
    out["ddp_uniform"] = (buckets, per_window, reduces, msgs)
    model, buckets, per_window, reduces, msgs = _ddp_optim_wrapper(rank, world, data_n, True, True)
    _check_close(model, ref_n, "DDP weighted")
    out["ddp_weighted"] = (buckets, per_window, reduces, msgs)
    # misuse: forward outside the no-sync context -> warned, every micro-batch all-reduced, still correct
    model, buckets, per_window, reduces, msgs = _ddp_optim_wrapper(rank, world, data_n, True, False)
    _check_close(model, ref_n, "DDP backward-only")
    out["ddp_misuse"] = (buckets, per_window, reduces, msgs)

    # FSDP2, weighted
    out["fsdp2"] = _fsdp2(rank, world, data_n, ref_n)
    out["fsdp2_plain_root"] = _fsdp2(rank, world, data_n, ref_n, shard_root=False)

    # ColossalAI API over DDP, weighted
    out["colossal"] = _colossal_ddp(rank, world, data_n, ref_n)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_and_fsdp2_exact_and_one_collective_per_window(world: int) -> None:
    results = run_distributed(_all_checks, world, timeout=240)
    for rank, out in enumerate(results):
        # DDP: each bucket all-reduced exactly once per window (and several buckets exist)
        buckets, per_window, reduces, msgs = out["ddp_uniform"]
        assert buckets >= 2, rank
        assert [len(w) for w in per_window] == [buckets] * WINDOWS
        assert all(len(set(w)) == buckets for w in per_window)
        assert reduces == [0] * WINDOWS  # unweighted: no extra collective
        assert msgs == []
        buckets, per_window, reduces, msgs = out["ddp_weighted"]
        assert [len(w) for w in per_window] == [buckets] * WINDOWS
        assert reduces == [1] * WINDOWS  # exactly one small all-reduce of the window weight
        assert msgs == []
        buckets, per_window, reduces, msgs = out["ddp_misuse"]
        assert [len(w) for w in per_window] == [K * buckets] * WINDOWS
        assert len(msgs) == 1 and "DDP arms its gradient all-reduce in the forward" in msgs[0]
        # FSDP2: one reduce-scatter per FSDP parameter group (2 sharded Linear layers) per window
        for key in ("fsdp2", "fsdp2_plain_root"):
            per_window, unguarded = out[key]
            assert per_window == [2] * WINDOWS, key
            assert unguarded == 2 * K, key
        buckets, per_window, misuse_calls, msgs = out["colossal"]
        assert per_window == [buckets] * WINDOWS
        assert misuse_calls == K * buckets
        assert len(msgs) == 1 and "wrapping only the backward does not help" in msgs[0]
