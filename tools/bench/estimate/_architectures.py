# SPDX-License-Identifier: Apache-2.0
"""The models of ``bench_estimate.py --architectures``: transformers models built from small configs (no
download) and the project's GPT, each with one seeded example micro-batch and its loss.

Every builder returns a fresh seeded model; :func:`inputs` the keyword arguments its forward takes (labels
included: the loss is the model's own, ``output.loss``). ``bert`` pads the second sequence so the attention mask
matters; ``mixtral`` routes tokens to experts by value. ``gpt`` is ``examples/gpt_demo_model.py``'s ByteGPT,
taking ``(ids)`` and returning logits (its loss is cross-entropy against the targets).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["ARCHITECTURES", "TINY_ARCHITECTURES", "build", "inputs", "loss_of"]

BATCH, SEQ, VOCAB = 4, 64, 4096


def _gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(
        GPT2Config(
            vocab_size=VOCAB, n_positions=SEQ, n_embd=256, n_layer=4, n_head=4, tie_word_embeddings=True
        )
    )


def _llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=SEQ,
        )
    )  # fmt: skip


def _bert() -> torch.nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    return BertForMaskedLM(
        BertConfig(
            vocab_size=VOCAB, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
            intermediate_size=1024, max_position_embeddings=SEQ,
        )
    )  # fmt: skip


def _t5() -> torch.nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(
        T5Config(
            vocab_size=VOCAB, d_model=256, d_kv=64, d_ff=1024, num_layers=3, num_decoder_layers=3,
            num_heads=4, decoder_start_token_id=0,
        )
    )  # fmt: skip


def _mixtral() -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(
        MixtralConfig(
            vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
            max_position_embeddings=SEQ,
        )
    )  # fmt: skip


def _vit() -> torch.nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    return ViTForImageClassification(
        ViTConfig(
            image_size=64, patch_size=8, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
            intermediate_size=1024, num_labels=10,
        )
    )  # fmt: skip


def _gpt() -> torch.nn.Module:
    from gpt_demo_model import ByteGPT

    return ByteGPT(256, 4, 4, SEQ)


#: name -> builder
ARCHITECTURES: dict[str, Callable[[], torch.nn.Module]] = {
    "gpt2": _gpt2,
    "llama-gqa": _llama,
    "bert": _bert,
    "t5": _t5,
    "mixtral-moe": _mixtral,
    "vit": _vit,
    "gpt": _gpt,
}
#: the architectures of ``--tiny`` and the CI test
TINY_ARCHITECTURES = ("gpt2", "bert")


def build(name: str, *, checkpointing: bool = False) -> torch.nn.Module:
    """Architecture ``name``, seeded; ``checkpointing``: transformers' ``activation_checkpointing_enable()``, or
    for ByteGPT each block in torch's ``checkpoint_wrapper`` (non-reentrant)."""
    torch.manual_seed(0)
    model = ARCHITECTURES[name]()
    if checkpointing and name == "gpt":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block)
    elif checkpointing:  # transformers 5's name for gradient_checkpointing_enable
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model


def inputs(name: str) -> dict[str, torch.Tensor]:
    """One micro-batch of ``name``: its forward's keyword arguments (ByteGPT: ``idx``)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    if name == "vit":
        return dict(pixel_values=torch.randn(BATCH, 3, 64, 64, generator=g), labels=ids[:, 0] % 10)
    if name == "gpt":
        return dict(idx=ids % 256)
    if name == "t5":
        return dict(input_ids=ids, labels=torch.randint(0, VOCAB, (BATCH, SEQ // 2), generator=g))
    batch = dict(input_ids=ids, labels=ids.clone())
    if name == "bert":
        mask = torch.ones_like(ids)
        mask[1, SEQ // 2 :] = 0
        batch["attention_mask"] = mask
    return batch


def loss_of(name: str, batch: dict[str, torch.Tensor]) -> Callable[[Any], torch.Tensor]:
    """The loss as a function of the output: the model's own (``output.loss``), ByteGPT's cross-entropy."""
    if name == "gpt":
        targets = batch["idx"].roll(-1, dims=1)
        return lambda logits: F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    return lambda output: output.loss
