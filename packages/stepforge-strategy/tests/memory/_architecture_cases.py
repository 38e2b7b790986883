# SPDX-License-Identifier: Apache-2.0
"""transformers models built from small configs (no download), trained two steps as rank 0 of 2 on torch's fake
process group with their buffers really allocated, beside ``estimate`` of the same rank: run in one fresh process
(``run_isolated``) for all cases. The collectives move nothing (values are garbage); what each rank allocates is
what it would allocate at 2 real ranks."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from stepforge.testing.fake_world import fake_group

VOCAB, BATCH, SEQ = 512, 2, 32


def build(name: str) -> nn.Module:
    """GPT-2 (tied head), BERT (masked LM) or Mixtral (mixture of experts), small, seeded."""
    import transformers as tf

    torch.manual_seed(0)
    if name == "gpt2":
        return tf.GPT2LMHeadModel(
            tf.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=2)
        )
    if name == "bert":
        config = tf.BertConfig(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256,
            max_position_embeddings=SEQ,
        )  # fmt: skip
        return tf.BertForMaskedLM(config)
    config = tf.MixtralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=SEQ,
    )  # fmt: skip
    return tf.MixtralForCausalLM(config)


def batch(name: str) -> dict[str, torch.Tensor]:
    """One micro-batch with labels (BERT's second sequence padded)."""
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    out = dict(input_ids=ids, labels=ids.clone())
    if name == "bert":
        mask = torch.ones_like(ids)
        mask[1, SEQ // 2 :] = 0
        out["attention_mask"] = mask
    return out


def measured_and_estimated(cases: list[tuple[str, str, str, bool]]) -> list[dict[str, Any]]:
    """Per ``(model, plugin, precision, activation checkpointing)``: the peak over step 2 and the total held after
    it (``MemTracker``), the estimate's, and the estimate's trace method."""
    from stepforge.core.torch_compat import memory_tracker, tracker_bytes
    from stepforge.strategy import Booster, estimate

    warnings.filterwarnings("ignore")
    out = []
    for name, plugin_name, precision, ckpt in cases:
        x = batch(name)
        plugin = dict(type=plugin_name, precision=precision)
        optimizer = dict(type="AdamW", lr=1e-4)
        est = estimate(
            lambda name=name: build(name), plugin, world_size=2, optimizer=optimizer, inputs=x,
            criterion=lambda output: output.loss, device="cpu", backend="fake", activation_checkpointing=ckpt,
        )  # fmt: skip
        with fake_group(0, 2):
            tracker = memory_tracker()
            with tracker:
                model = build(name)
                if ckpt:
                    model.gradient_checkpointing_enable(
                        gradient_checkpointing_kwargs={"use_reentrant": False}
                    )
                booster = Booster(plugin=plugin)
                model, opt, *_ = booster.boost(model, optimizer)
                booster.backward(model(**x).loss, opt)
                opt.step()
                opt.zero_grad()
                tracker.reset_mod_stats()
            with tracker:  # entering again starts the peak from here: step 2's
                booster.backward(model(**x).loss, opt)
                opt.step()
                held = tracker_bytes(tracker, "current")["cpu"]["Total"]
            peak = tracker_bytes(tracker, "peak")["cpu"]["Total"]
        components = ("params", "grads", "master", "optimizer_state", "buffers")
        out.append(
            dict(
                case=(name, plugin_name, precision, ckpt),
                peak=peak,
                held=held,
                est_peak=est.peak(None),
                est_held=sum(est.device[c] + est.host[c] for c in components),
                trace=est.activations.method,
            )
        )
    return out
