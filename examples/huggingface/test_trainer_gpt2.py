# SPDX-License-Identifier: Apache-2.0
"""transformers.Trainer trains the tiny GPT-2 with stepforge's CPUAdam; its gradient accumulation is compared
with stepforge.accum's (mmengine-style weighted windows) and ColossalAI's ``accumulate_gradient`` semantics.

Run by ``nox -s integrations``.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from trainer_gpt2 import ArithmeticSequences, make_model, make_trainer

from stepforge.accum import GradAccumOptimizer, OptimWrapper
from stepforge.fused import CPUAdam, FusedSGD

pytestmark = pytest.mark.filterwarnings(
    "ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning"
)

LR = 1e-2
# accumulation is compared with SGD, whose update is linear in the gradient: Adam divides by sqrt(v), which turns
# rounding-level gradient differences of near-zero gradients into visible weight differences
SGD_LR = 0.5
BATCH = 2  # make_trainer's per_device_train_batch_size


def _trained(trainer) -> dict[str, torch.Tensor]:
    trainer.train()
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def _micro_batches(data: ArithmeticSequences) -> list[dict[str, torch.Tensor]]:
    rows = [data[i] for i in range(len(data))]
    return [
        {k: torch.stack([r[k] for r in rows[i : i + BATCH]]) for k in rows[0]}
        for i in range(0, len(rows), BATCH)
    ]


def _label_tokens(batch: dict[str, torch.Tensor]) -> int:
    # a causal LM predicts labels[1:]; the first position of each row is never a target
    return int(batch["labels"][:, 1:].ne(-100).sum())


def _stepforge_window(data: ArithmeticSequences, counts: int, weighted: bool) -> dict[str, torch.Tensor]:
    """stepforge.accum.OptimWrapper: mmengine's loop, windows of ``counts``, the last (partial) window stepped."""
    model = make_model()
    wrapper = OptimWrapper(FusedSGD(model.parameters(), lr=SGD_LR), accumulative_counts=counts)
    batches = _micro_batches(data)
    wrapper.initialize_count_status(model, 0, len(batches))
    for batch in batches:
        with wrapper.optim_context(model):
            loss = model(**batch).loss  # mean over this micro-batch's label tokens
        wrapper.update_params(loss, num_items=_label_tokens(batch) if weighted else None)
    return model.state_dict()


def _colossalai_style(data: ArithmeticSequences, size: int) -> dict[str, torch.Tensor]:
    """ColossalAI's accumulate_gradient: every loss divided by ``size``; the epoch's tail is dropped."""
    model = make_model()
    optimizer = GradAccumOptimizer(FusedSGD(model.parameters(), lr=SGD_LR), size, model=model)
    batches = _micro_batches(data)
    for batch in batches[: len(batches) - len(batches) % size]:  # GradAccumDataloader's length
        optimizer.zero_grad()
        with optimizer.optim_context():
            optimizer.backward(model(**batch).loss)
        optimizer.step()
    return model.state_dict()


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_both_trainer_routes_train_with_cpu_adam(tmp_path):
    data = ArithmeticSequences(size=8)
    by_cls = make_trainer(str(tmp_path / "cls"), route="cls", lr=LR, dataset=data)
    by_instance = make_trainer(str(tmp_path / "instance"), route="instance", lr=LR, dataset=data)
    initial = make_model().state_dict()
    cls_state, instance_state = _trained(by_cls), _trained(by_instance)
    # the Trainer wraps our optimizer (accelerate's AcceleratedOptimizer) and steps it
    assert type(by_cls.optimizer.optimizer) is CPUAdam
    assert type(by_instance.optimizer.optimizer) is CPUAdam
    assert _max_diff(cls_state, initial) > 1e-3
    for key, value in cls_state.items():
        assert torch.equal(instance_state[key], value), key


def test_accumulation_with_equal_lengths_agrees_across_all_three(tmp_path):
    data = ArithmeticSequences(size=8)  # 4 micro-batches of 2: two full windows, same token count each
    trainer_state = _trained(
        make_trainer(str(tmp_path / "t"), lr=SGD_LR, accumulation=2, dataset=data, optimizer_cls=FusedSGD)
    )
    for other in (
        _stepforge_window(data, 2, weighted=True),
        _stepforge_window(data, 2, weighted=False),
        _colossalai_style(data, 2),
    ):
        assert _max_diff(trainer_state, other) < 1e-6
    assert _max_diff(trainer_state, make_model().state_dict()) > 1e-3


def test_ragged_tokens_and_a_partial_window_match_stepforge_weighted_only(tmp_path):
    # 5 micro-batches with different label-token counts, windows of 2: [2, 2, 1]
    data = ArithmeticSequences(size=10, ragged=True, seed=1)
    counts = [_label_tokens(b) for b in _micro_batches(data)]
    assert len(set(counts)) > 1, counts
    trainer_state = _trained(
        make_trainer(str(tmp_path / "t"), lr=SGD_LR, accumulation=2, dataset=data, optimizer_cls=FusedSGD)
    )
    weighted = _stepforge_window(data, 2, weighted=True)
    # Trainer divides by the window's label tokens (num_items_in_batch) and steps the partial last window:
    # exactly stepforge's weighted window
    assert _max_diff(trainer_state, weighted) < 1e-6
    # a mean of per-micro-batch means (mmengine, stepforge unweighted) and ColossalAI's dropped tail differ
    unweighted, colossalai = _stepforge_window(data, 2, weighted=False), _colossalai_style(data, 2)
    print(
        "max |weight difference| to Trainer: weighted",
        _max_diff(trainer_state, weighted),
        "unweighted",
        _max_diff(trainer_state, unweighted),
        "ColossalAI-style",
        _max_diff(trainer_state, colossalai),
    )
    assert _max_diff(trainer_state, unweighted) > 1e-4
    assert _max_diff(trainer_state, colossalai) > 1e-4
