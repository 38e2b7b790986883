# SPDX-License-Identifier: Apache-2.0
"""ColossalAI API: accumulate_gradient and its four wrappers (single process).

References are plain-torch loops on the concatenated window (written here, independent of the package).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch.utils.data import DataLoader

from stepforge.accum import (
    AccumulationWarning,
    GradAccumDataloader,
    GradAccumGradientHandler,
    GradAccumLrSchedulerByStep,
    GradAccumOptimizer,
    accumulate_gradient,
)
from stepforge.core import HyperParameterError
from stepforge.testing.accum_cases import (
    assert_params_close,
    big_batch_reference,
    mse,
    param_copies,
    regression_dataset,
    tiny_mlp,
    train_colossalai_order,
)


def _big_batches(batches, window_sizes, epochs=1):
    """The big-batch reference over consecutive windows of ``window_sizes`` batches (momentum SGD, lr 0.1)."""
    windows, start = [], 0
    for size in window_sizes:
        windows.append(batches[start : start + size])
        start += size
    return big_batch_reference(windows * epochs, lr=0.1, momentum=0.9)


class _Handler:
    def __init__(self):
        self.calls = 0

    def handle_gradient(self):
        self.calls += 1


def test_accumulate_gradient_drops_tail_like_colossalai_and_equals_big_batches() -> None:
    ds = regression_dataset(22)  # 11 batches of 2, size 3 -> 9 per epoch, 3 windows
    model = tiny_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    handler = _Handler()
    optim, loader, handlers, lr_sched = accumulate_gradient(
        model, opt, DataLoader(ds, batch_size=2), 3, gradient_handlers=[handler], lr_scheduler=sched
    )
    assert isinstance(optim, GradAccumOptimizer) and isinstance(loader, GradAccumDataloader)
    assert isinstance(handlers[0], GradAccumGradientHandler)
    assert isinstance(lr_sched, GradAccumLrSchedulerByStep)
    assert len(loader) == 9
    train_colossalai_order(loader, model, optim, lr_sched, handlers, epochs=2)
    batches = list(DataLoader(ds, batch_size=2))
    # reference with the same per-window lr decay
    ref_model = tiny_mlp()
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.9)
    for _ in range(2):
        for w in range(3):
            ref_opt.zero_grad()
            chunk = batches[3 * w : 3 * w + 3]
            mse(ref_model, torch.cat([b[0] for b in chunk]), torch.cat([b[1] for b in chunk])).backward()
            ref_opt.step()
            ref_sched.step()
    assert_params_close(param_copies(model), param_copies(ref_model))
    assert handler.calls == 6
    assert sched.last_epoch == 6
    assert GradAccumLrSchedulerByStep.compute_effective_steps_per_epoch(DataLoader(ds, batch_size=2), 3) == 3


def test_drop_last_false_keeps_the_tail_as_a_short_window() -> None:
    ds = regression_dataset(22)  # 11 batches per epoch: windows 3, 3, 3, 2
    model = tiny_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=1.0)
    handler = _Handler()
    optim, loader, handlers, lr_sched = accumulate_gradient(
        model, opt, DataLoader(ds, batch_size=2), 3, [handler], sched, drop_last=False
    )
    assert len(loader) == 11
    train_colossalai_order(loader, model, optim, lr_sched, handlers, epochs=2)
    ref = _big_batches(list(DataLoader(ds, batch_size=2)), [3, 3, 3, 2], epochs=2)
    assert_params_close(param_copies(model), ref)
    assert handler.calls == 8
    assert sched.last_epoch == 8  # the tail window counts as one scheduler step
    assert optim.accumulate_step == 0


def test_weighted_backward_with_uneven_batches_and_tail() -> None:
    # uneven batch sizes inside windows, weighted by sample count, tail kept
    sizes = [3, 1, 4, 2, 5]
    ds = regression_dataset(sum(sizes))
    batches, i = [], 0
    for s in sizes:
        batches.append((ds.tensors[0][i : i + s], ds.tensors[1][i : i + s]))
        i += s
    model = tiny_mlp()
    optim, loader, _, _ = accumulate_gradient(
        model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), batches, 3, drop_last=False
    )
    for x, y in loader:
        optim.zero_grad()
        with optim.optim_context():
            optim.backward(mse(model, x, y), weight=len(x))
        optim.clip_grad_norm(model, 1e9)
        optim.step()
    assert_params_close(param_copies(model), _big_batches(batches, [3, 2]))


def test_optimizer_semantics_step_zero_grad_and_clip() -> None:
    model = tiny_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    optim = GradAccumOptimizer(opt, accumulate_size=2, model=model)
    ds = regression_dataset(4)
    x, y = ds.tensors
    assert optim.step() is None  # nothing accumulated
    optim.backward(mse(model, x, y))
    assert optim.accumulate_step == 1
    assert optim.step() is None and optim.clip_grad_norm(model, 1.0) is None
    g1 = [p.grad.clone() for p in model.parameters()]
    optim.zero_grad()  # mid-window: no effect
    assert_params_close([p.grad for p in model.parameters()], g1)
    optim.backward(mse(model, x, y))
    # both halves divided by 2: the accumulated gradient equals the full-batch gradient
    ref = tiny_mlp()
    mse(ref, x, y).backward()
    assert_params_close([p.grad for p in model.parameters()], [p.grad for p in ref.parameters()])
    norm = optim.clip_grad_norm(model, 1e-3)
    assert norm is not None and norm.item() > 1e-3
    assert optim.step(lambda: torch.tensor(7.0)).item() == 7.0  # the inner step ran, its result returned
    assert optim.accumulate_step == 0
    optim.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    assert optim.param_groups is opt.param_groups and optim.defaults is opt.defaults
    assert optim.state is opt.state


def test_backward_by_grad_counts_like_backward() -> None:
    model = tiny_mlp()
    optim = GradAccumOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 2)
    x, y = regression_dataset(4).tensors
    out = (model(x) - y).pow(2).mean() / 2
    optim.backward_by_grad(out, torch.ones_like(out))
    assert optim.accumulate_step == 1


def test_state_dicts_keep_counters_and_resume_exactly() -> None:
    ds = regression_dataset(40)  # 20 batches, size 3, drop_last=False: windows 3*6 + 2

    def build(seed=0):
        model = tiny_mlp(seed)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        handler = _Handler()
        objs = accumulate_gradient(
            model, opt, DataLoader(ds, batch_size=2), 3, [handler], sched, drop_last=False
        )
        return model, objs, handler

    model, (optim, loader, handlers, sched), _ = build()
    train_colossalai_order(loader, model, optim, sched, handlers)
    straight = param_copies(model)

    model, (optim, loader, handlers, sched), _ = build()
    it = iter(loader)
    for _ in range(9):  # three windows, stop at a boundary
        x, y = next(it)
        optim.zero_grad()
        with optim.optim_context():
            optim.backward(mse(model, x, y))
        handlers[0].handle_gradient()
        optim.step()
        sched.step()
    ckpt = copy.deepcopy(
        {
            "model": model.state_dict(),
            "optim": optim.state_dict(),
            "loader": loader.state_dict(),
            "sched": sched.state_dict(),
            "handler": handlers[0].state_dict(),
        }
    )
    assert ckpt["optim"]["accumulation"]["inner_count"] == 9 and ckpt["loader"]["cur_step"] == 9
    assert ckpt["sched"]["seen_steps"] == 3

    model2, (optim2, loader2, handlers2, sched2), _ = build(seed=3)
    model2.load_state_dict(ckpt["model"])
    optim2.load_state_dict(ckpt["optim"])
    loader2.load_state_dict(ckpt["loader"])
    sched2.load_state_dict(ckpt["sched"])
    handlers2[0].load_state_dict(ckpt["handler"])
    train_colossalai_order(
        loader2, model2, optim2, sched2, handlers2
    )  # replays the first 9 batches, trains the rest
    assert_params_close(param_copies(model2), straight)
    assert sched2.lr_scheduler.last_epoch == 7


def test_standalone_scheduler_and_handler_count_calls_and_save_counters() -> None:
    opt = torch.optim.SGD(tiny_mlp().parameters(), lr=1.0)
    sched = GradAccumLrSchedulerByStep(torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5), accumulate_size=3)
    handler = _Handler()
    wrapped = GradAccumGradientHandler(handler, 3)
    for _ in range(4):
        opt.step()
        sched.step()
        wrapped.handle_gradient()
    assert sched.lr_scheduler.last_epoch == 1 and sched.get_last_lr() == [0.5]
    assert handler.calls == 1 and wrapped.state_dict() == {"accumulate_step": 1}
    state = sched.state_dict()
    assert state["accumulate_step"] == 1
    sched2 = GradAccumLrSchedulerByStep(torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5), 3)
    sched2.load_state_dict(state)
    assert sched2.accumulate_step == 1 and sched2.last_epoch == 1  # __getattr__ reaches the inner one
    sched2.load_state_dict(state["lr_scheduler"])  # ColossalAI layout: inner state only
    with pytest.raises(TypeError, match="GradAccumOptimizer or OptimWrapper"):
        GradAccumLrSchedulerByStep(sched2.lr_scheduler, 3, optimizer=opt)
    with pytest.raises(TypeError, match="handle_gradient"):
        GradAccumGradientHandler(object(), 3)


def test_stepping_the_inner_scheduler_directly_warns() -> None:
    opt = torch.optim.SGD(tiny_mlp().parameters(), lr=1.0)
    inner = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    sched = GradAccumLrSchedulerByStep(inner, 3)
    opt.step()
    inner.step()  # the misuse: the raw scheduler per micro-batch
    with pytest.warns(AccumulationWarning, match="stepped outside the wrapper"):
        sched.step()


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before:UserWarning")
def test_lr_changing_inside_a_window_warns() -> None:
    model = tiny_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    inner = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    optim = GradAccumOptimizer(opt, 3, model)
    x, y = regression_dataset(4).tensors
    with pytest.warns(AccumulationWarning, match="scheduler is stepped per micro-batch"):
        for _ in range(3):
            optim.backward(mse(model, x, y))
            inner.step()


class _NonTorchLoader:
    """A sized iterable that is not a DataLoader (DALI-like): the tail must be drained."""

    def __init__(self, n):
        self.n = n
        self.consumed = 0
        self.extra = "attr"

    def __len__(self):
        return self.n

    def __iter__(self):
        for i in range(self.n):
            self.consumed += 1
            yield i


def test_dataloader_drains_non_standard_loaders_and_delegates() -> None:
    raw = _NonTorchLoader(8)
    loader = GradAccumDataloader(raw, 3)
    assert list(loader) == [0, 1, 2, 3, 4, 5]
    assert raw.consumed == 8  # the tail was read and dropped
    assert loader.extra == "attr"
    torch_loader = DataLoader(list(range(8)), batch_size=1)
    wrapped = GradAccumDataloader(torch_loader, 3)
    assert [int(b) for b in wrapped] == [0, 1, 2, 3, 4, 5]
    assert len(GradAccumDataloader(raw, 3, drop_last=False)) == 8
    with pytest.raises(TypeError, match="sized data loader"):
        len(GradAccumDataloader(iter(range(3)), 3))


def test_backward_only_no_sync_is_silent_without_ddp_and_size_errors() -> None:
    model = tiny_mlp()
    optim = GradAccumOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 2, model)
    x, y = regression_dataset(4).tensors
    with warnings.catch_warnings():
        warnings.simplefilter("error", AccumulationWarning)
        optim.backward(mse(model, x, y))  # a plain module has nothing to synchronise
    for bad in (0, -2, 2.5):
        with pytest.raises(HyperParameterError, match="accumulate_size"):
            GradAccumOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), bad)
        with pytest.raises(HyperParameterError, match="accumulate_size"):
            GradAccumDataloader([1, 2], bad)
