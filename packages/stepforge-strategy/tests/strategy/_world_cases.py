# SPDX-License-Identifier: Apache-2.0
"""The runs of test_world_size_change.py (importable by spawned ranks): one Strategy run with
``global_batch_size=GLOBAL`` and a ``DistributedSampler`` loader of micro-batch 1, trained to a step, saved,
resumed at another world size.

A run at world size ``W`` accumulates ``GLOBAL / W`` micro-batches per optimizer step, so every step consumes the
next ``GLOBAL`` samples of the epoch's order whatever ``W`` is, and the gradient is their mean at every size: the
reference (:func:`reference`) is plain torch on one process, written from that rule, not through the Strategy.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from _strategy_cases import full_params, make_strategy
from torch import nn
from torch.utils.data import Dataset

from stepforge.strategy import Strategy, make_stateful

N = 36  # samples per epoch: 3 optimizer steps
GLOBAL = 12  # divides over 1, 2, 3 and 4 ranks of micro-batch 1
STEPS = 7  # optimizer steps of the whole run (two epochs and one step)
SEED = 11  # the sampler's seed
LR, GAMMA = 0.05, 0.5  # MultiStepLR at every epoch boundary


class Samples(Dataset):
    """Sample ``i``: its id, an input and a target, fixed by ``i``."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(4)
        self.x, self.y = torch.randn(N, 8, generator=g), torch.randn(N, 4, generator=g)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return i, self.x[i], self.y[i]


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def plugin_cfg(name: str) -> Any:
    return name if name in ("torch_ddp", "torch_fsdp") else dict(type=name, precision="fp32")


def prepare_run(s: Strategy, world_size: int) -> Any:
    """Build the loader, register it (before ``prepare``: ``resume="auto"`` restores it there), prepare ``s``;
    returns the loader."""
    # ColossalAI's signature; the ZeRO plugins return a plain DataLoader, which make_stateful wraps
    loader = make_stateful(s.plugin.prepare_dataloader(Samples(), batch_size=1, shuffle=True, seed=SEED))
    s.register_for_checkpointing("loader", loader)
    s.prepare(
        make_model(),
        optim_wrapper=dict(optimizer=dict(type="AdamW", lr=LR, weight_decay=0.01)),
        param_scheduler=[
            dict(
                type="MultiStepLR",
                milestones=[1, 2],
                gamma=GAMMA,
                end=3,
                by_epoch=True,
                convert_to_iter_based=True,
            )
        ],
        dispatch_kwargs=dict(
            max_iters=STEPS * GLOBAL // world_size, epoch_length=len(loader), train_micro_batch_size_per_gpu=1
        ),
    )
    return loader


def batches(loader: Any) -> Iterator[Any]:
    """The loader's batches, epoch after epoch (one iterator for the whole run, as a training loop holds it)."""
    while True:
        yield from loader


def train(s: Strategy, stream: Iterator[Any], until: int) -> dict[str, Any]:
    """Train to optimizer step ``until`` from :func:`batches`; the ids each iteration drew on this rank (by
    iteration) and the lr each optimizer step used."""
    model, wrapper, schedulers = s._components()
    model.train()
    window = wrapper._window
    ids: dict[int, list[int]] = {}
    lrs: list[float] = []
    while window.steps < until:
        sample_ids, x, y = next(stream)
        it, steps, lr = window.inner_count, window.steps, wrapper.param_groups[0]["lr"]
        with wrapper.optim_context(model):
            loss = (model(x) - y).square().mean()
        wrapper.update_params(loss)
        if window.steps != steps:
            lrs.append(lr)
        for sched in schedulers:
            sched.step()
        ids[it] = sample_ids.tolist()
    return dict(ids=ids, lrs=lrs)


def counters(s: Strategy, loader: Any) -> dict[str, Any]:
    _, wrapper, schedulers = s._components()
    window = wrapper._window
    return dict(
        counts=wrapper.accumulative_counts,
        cur_iter=s.dispatch_kwargs.get("cur_iter"),
        inner_count=window.inner_count,
        steps=window.steps,
        sched_clock=schedulers[0]._global_step,
        epoch_length=len(loader),
        loader=loader.state_dict(),
        lr=wrapper.param_groups[0]["lr"],
    )


def leg(
    rank: int, world_size: int, work: str, plugin: str, source: str | None, until: int, save: str
) -> dict:
    """Resume ``source`` (None: start fresh) at this world size, train to step ``until``, save ``save``."""
    s = make_strategy(os.path.join(work, f"run-{save}"), plugin=plugin_cfg(plugin), global_batch_size=GLOBAL)
    loader = prepare_run(s, world_size)
    resumed = None
    if source is not None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="resume: the checkpoint's seed")
            s.resume(os.path.join(work, source))
        resumed = counters(s, loader)
    got = train(s, batches(loader), until)
    s.save_checkpoint(os.path.join(work, save))
    # the ZeRO plugins' model keeps its "module." prefix in the state dict; the reference has none
    params = {k.removeprefix("module."): v for k, v in full_params(s.model).items()}
    out = dict(resumed=resumed, params=params, **got)
    s.close()
    return out


def reference() -> list[dict[str, torch.Tensor]]:
    """Plain torch on one process: step ``k`` of epoch ``e`` takes samples ``order[12j : 12j + 12]`` (``j = k mod
    3``) of DistributedSampler's documented order (``randperm(N)`` seeded with ``seed + epoch``), the mean loss over
    them, AdamW, lr halved at each epoch boundary. The parameters after each step."""
    data = Samples()
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    out = []
    for k in range(STEPS):
        epoch, j = divmod(k, N // GLOBAL)
        order = torch.randperm(N, generator=torch.Generator().manual_seed(SEED + epoch))
        ids = order[j * GLOBAL : (j + 1) * GLOBAL]
        for group in opt.param_groups:
            group["lr"] = LR * GAMMA**epoch
        opt.zero_grad()
        per_sample = (model(data.x[ids]) - data.y[ids]).square().mean(dim=1)
        per_sample.mean().backward()
        opt.step()
        out.append({f"{n}": p.detach().clone() for n, p in model.named_parameters()})
    return out


def expected_ids(step: int) -> set[int]:
    epoch, j = divmod(step, N // GLOBAL)
    order = torch.randperm(N, generator=torch.Generator().manual_seed(SEED + epoch)).tolist()
    return set(order[j * GLOBAL : (j + 1) * GLOBAL])
