# SPDX-License-Identifier: Apache-2.0
"""A tiny GPT-2 trained by ``transformers.Trainer`` with a stepforge optimizer (no download: config + local data).

Run: ``python examples/huggingface/trainer_gpt2.py [--route cls|instance] [--accumulation 2]``.

Two ways in, both public Trainer API:

- ``Trainer(..., optimizer_cls_and_kwargs=(CPUAdam, dict(lr=...)))``: the Trainer builds the optimizer over its
  own parameter groups (weight decay off for biases and LayerNorm weights);
- ``Trainer(..., optimizers=(CPUAdam(model.parameters(), lr=...), None))``: you build it (any param groups).

The data are arithmetic sequences of tokens (``t_i = start + i * step mod vocab``), optionally ragged (right
padding, labels ``-100`` there), so a causal LM learns them in a few steps.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from stepforge.fused import CPUAdam

__all__ = ["ArithmeticSequences", "make_model", "make_args", "make_trainer"]

VOCAB = 64


class ArithmeticSequences(Dataset):
    """``size`` rows ``dict(input_ids=int64[length], attention_mask=int64[length], labels=int64[length])``.

    Args:
        size: number of sequences.
        length: tokens per row (after padding).
        ragged: rows hold 4..length real tokens, right-padded with token 0, ``attention_mask`` 0 and
            ``labels`` -100 on the padding (so micro-batches hold different numbers of label tokens).
        seed: the generator's seed.
    """

    def __init__(self, size: int = 16, length: int = 16, ragged: bool = False, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (size, 1), generator=g)
        step = torch.randint(1, 5, (size, 1), generator=g)
        self.input_ids = (start + step * torch.arange(length)) % VOCAB
        if ragged:
            lengths = torch.randint(4, length + 1, (size,), generator=g)
        else:
            lengths = torch.full((size,), length)
        self.attention_mask = (torch.arange(length) < lengths[:, None]).long()
        self.input_ids = self.input_ids * self.attention_mask
        self.labels = self.input_ids.masked_fill(self.attention_mask == 0, -100)

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {
            "input_ids": self.input_ids[index],
            "attention_mask": self.attention_mask[index],
            "labels": self.labels[index],
        }


def make_model(seed: int = 0) -> GPT2LMHeadModel:
    """A 2-layer, 32-wide GPT-2 built from its config (no weights downloaded), dropout off."""
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=VOCAB - 1,
        eos_token_id=VOCAB - 1,
    )
    model = GPT2LMHeadModel(config)
    # transformers derives loss_type from the class name, and "GPT2LMHeadModel" matches none: named here, Trainer
    # knows the loss shifts the labels and counts num_items_in_batch over labels[..., 1:]; left unset, it also
    # counts each row's first label, which is never a target (the window is normalised by N + rows, not N)
    model.loss_type = "ForCausalLM"
    return model


def make_args(
    output_dir: str, *, batch_size: int = 2, accumulation: int = 1, **overrides: Any
) -> TrainingArguments:
    """CPU, one epoch, data in order, constant learning rate, no clipping, no checkpoints, no reporting."""
    kwargs: dict[str, Any] = dict(
        output_dir=output_dir,
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=accumulation,
        num_train_epochs=1,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=0.0,
        train_sampling_strategy="sequential",
        save_strategy="no",
        report_to="none",
        logging_steps=1,
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def make_trainer(
    output_dir: str,
    *,
    route: str = "cls",
    lr: float = 1e-2,
    accumulation: int = 1,
    dataset: Dataset | None = None,
    optimizer_cls: type[torch.optim.Optimizer] = CPUAdam,
) -> Trainer:
    """A Trainer for the tiny GPT-2 whose optimizer is ``optimizer_cls`` (stepforge's ``CPUAdam`` by default).

    Args:
        route: ``"cls"`` (``optimizer_cls_and_kwargs``) or ``"instance"`` (``optimizers=``).
    """
    model = make_model()
    args = make_args(output_dir, accumulation=accumulation, learning_rate=lr)
    data = dataset if dataset is not None else ArithmeticSequences()
    if route == "cls":
        return Trainer(
            model=model, args=args, train_dataset=data, optimizer_cls_and_kwargs=(optimizer_cls, dict(lr=lr))
        )
    if route == "instance":
        optimizer = optimizer_cls(model.parameters(), lr=lr)
        return Trainer(model=model, args=args, train_dataset=data, optimizers=(optimizer, None))
    raise ValueError(
        f"route must be 'cls' (optimizer_cls_and_kwargs) or 'instance' (optimizers=), got {route!r}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--route", choices=["cls", "instance"], default="cls")
    parser.add_argument("--accumulation", type=int, default=1, help="gradient_accumulation_steps")
    parser.add_argument("--output-dir", default="hf-out")
    args = parser.parse_args()
    trainer = make_trainer(args.output_dir, route=args.route, accumulation=args.accumulation)
    result = trainer.train()
    print(
        f"optimizer: {type(trainer.optimizer.optimizer).__name__}, final train loss {result.training_loss:.4f}"
    )


if __name__ == "__main__":
    main()
