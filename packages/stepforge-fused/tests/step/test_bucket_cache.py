# SPDX-License-Identifier: Apache-2.0
"""``_bucket_cache.BucketCache``: building, per-step revalidation and grad refresh of the buckets of each group."""

from __future__ import annotations

import torch

from stepforge.fused import FusedAdam, FusedSGD
from stepforge.fused._step.buckets import BucketCache, device_steps
from stepforge.testing.tensors import bits_equal, clone_params


def _twins(n=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ours = [torch.nn.Parameter(torch.randn(5 + i, generator=gen)) for i in range(n)]
    return ours, clone_params(ours)


def test_buckets_group_by_dtype_and_point_at_the_grads():
    ps = [torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(3).bfloat16())]
    for p in ps:
        p.grad = torch.ones_like(p)
    opt = FusedAdam(ps)
    cache = BucketCache()
    buckets = cache.group_buckets(opt, 0, opt.param_groups[0])
    assert [(b.param_dtype, list(b.sizes)) for b in buckets] == [(torch.float32, [4]), (torch.bfloat16, [3])]
    assert [b.ptrs["grads"][0] for b in buckets] == [p.grad.data_ptr() for p in ps]
    assert cache.group_buckets(opt, 0, opt.param_groups[0]) is buckets, "unchanged grads: the same buckets"


def test_grads_seen_once_are_refreshed_and_watched_when_seen_again():
    p = torch.nn.Parameter(torch.randn(6))
    p.grad = torch.ones(6)
    opt = FusedAdam([p])
    cache = opt._bucket_cache
    group = opt.param_groups[0]
    cache.group_buckets(opt, 0, group)
    entry = cache.entries[0]
    assert not entry.watched and entry.grad_refs == []
    p.grad = torch.full((6,), 2.0)  # a new grad object (zero_grad(set_to_none=True) + backward)
    (bucket,) = cache.group_buckets(opt, 0, group)
    assert cache.entries[0] is entry, "new grads refresh the pointers, they do not rebuild"
    assert bucket.ptrs["grads"][0] == p.grad.data_ptr() and not entry.watched
    cache.group_buckets(opt, 0, group)
    assert entry.watched and len(entry.grad_refs) == 1


def test_a_grad_storage_swapped_before_it_is_watched_is_still_followed():
    """grad.data swapped right after the first step (its storage not watched yet): the next step must read
    the new storage, as torch does."""
    ours, ref = _twins()
    opt = FusedAdam(ours, lr=1e-2)
    torch_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.0, fused=True)
    for p, q in zip(ours, ref, strict=True):
        p.grad = torch.randn(p.shape)
        q.grad = p.grad.clone()
    opt.step(), torch_opt.step()
    for p, q in zip(ours, ref, strict=True):
        p.grad.data = torch.randn(p.shape)  # same grad object, other memory
        q.grad = p.grad.clone()
    opt.step(), torch_opt.step()
    assert bits_equal(ours, ref)


def test_fresh_grads_every_step_match_torch():
    ours, ref = _twins(n=4, seed=2)
    opt = FusedSGD(ours, lr=0.1, momentum=0.9)
    torch_opt = torch.optim.SGD(ref, lr=0.1, momentum=0.9)
    for _ in range(4):
        for p, q in zip(ours, ref, strict=True):
            p.grad = torch.randn(p.shape)
            q.grad = p.grad.clone()
        opt.step(), torch_opt.step()
    assert bits_equal(ours, ref)


def test_invalidate_and_release_grads():
    p = torch.nn.Parameter(torch.randn(3))
    p.grad = torch.ones(3)
    opt = FusedAdam([p])
    opt.step()
    opt.step()
    entry = opt._bucket_cache.entries[0]
    opt._bucket_cache.release_grads()
    assert entry.grads == [] and entry.grad_refs == [] and entry.stale[0] and not entry.watched
    opt._bucket_cache.invalidate()
    assert opt._bucket_cache.entries == {}


def test_stable_grads_hooks_rebuild_only_for_new_grad_tensors():
    model = torch.nn.Linear(3, 2)
    opt = FusedAdam(model.parameters(), assume_stable_grads=True)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    cache = opt._bucket_cache
    assert set(cache.hooks) == {id(p) for p in model.parameters()} and cache.entries[0].hooked
    model(torch.randn(4, 3)).sum().backward()  # accumulated into the known grads: kept
    assert cache.entries
    opt.zero_grad(set_to_none=True)
    model(torch.randn(4, 3)).sum().backward()  # new grad tensors: the hook drops the cache
    assert cache.entries == {}


def test_device_steps_keep_an_existing_flat_tensor_and_build_one_otherwise():
    flat = torch.tensor([1.0, 2.0, 3.0])
    assert device_steps([flat[0], flat[1], flat[2]], torch.device("cpu")) is flat
    got = device_steps([torch.tensor(4.0), torch.tensor(5.0)], torch.device("cpu"))
    assert got.tolist() == [4.0, 5.0] and got.dtype == torch.float32
    assert device_steps([0, 0], torch.device("cpu")).tolist() == [0.0, 0.0]
