# SPDX-License-Identifier: Apache-2.0
"""The GPT the one-GPU benches train: its shapes, its parameter and FLOP counts, and how it is built on the meta
device and materialised on the device it trains on (a multi-billion-parameter fp32 init on the host would take
minutes; on the GPU it takes a fraction of a second), or built lazily for a plugin to materialise (:func:`build_lazy`).

A pre-norm decoder: token and position embeddings, ``layers`` blocks (LayerNorm, fused QKV with bias, causal
``scaled_dot_product_attention``, output projection, LayerNorm, 4x GELU MLP), a final LayerNorm and an output head
tied to the token embedding (GPT-2's layout: ``gpt2-124m`` has GPT-2 small's 124 M parameters with the vocabulary
padded to 50 304). Each block holds ``12 d^2 + 13 d`` parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "GPTShape", "SHAPES", "build", "capacity_shape", "random_batch"]


@dataclass(frozen=True)
class GPTShape:
    """A GPT's dimensions; ``seq_len`` is the context the position table holds and the benches train at."""

    layers: int
    d_model: int
    heads: int
    vocab: int = 50304
    seq_len: int = 1024

    @property
    def parameters(self) -> int:
        """Trainable parameters (the tied head counted once)."""
        d = self.d_model
        return self.layers * (12 * d * d + 13 * d) + self.vocab * d + self.seq_len * d + 2 * d

    @property
    def flops_per_token(self) -> float:
        """Training FLOPs per token: ``6 P`` for the matrix multiplies of forward and backward plus
        ``12 L d T`` for the attention scores and their use (PaLM's appendix B count, nanoGPT's MFU; the causal
        mask is not subtracted)."""
        return 6.0 * self.parameters + 12.0 * self.layers * self.d_model * self.seq_len

    def with_layers(self, layers: int) -> GPTShape:
        """The same shape with ``layers`` blocks."""
        return replace(self, layers=layers)


#: the named shapes; ``tiny`` is the CPU smoke size
SHAPES: dict[str, GPTShape] = {
    "gpt2-124m": GPTShape(12, 768, 12),
    "gpt-1.3b": GPTShape(24, 2048, 16),
    "tiny": GPTShape(2, 64, 4, vocab=512, seq_len=32),
}


def capacity_shape(
    layers: int, *, d_model: int = 4096, heads: int = 32, vocab: int = 50304, seq_len: int = 1024
) -> GPTShape:
    """The capacity search's shape: hidden size ``d_model`` (4096: about 201 M parameters per block)."""
    return GPTShape(layers, d_model, heads, vocab, seq_len)


class _Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    """int64 tokens ``(batch, t <= seq_len)`` -> logits ``(batch, t, vocab)``."""

    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        if shape.d_model % shape.heads:
            raise ValueError(f"GPT: d_model {shape.d_model} is not a multiple of heads {shape.heads}")
        self.shape = shape
        d = shape.d_model
        self.tok, self.pos = nn.Embedding(shape.vocab, d), nn.Embedding(shape.seq_len, d)
        self.blocks = nn.ModuleList(_Block(d, shape.heads) for _ in range(shape.layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, shape.vocab, bias=False)
        self.tie()

    def tie(self) -> None:
        """Share the head's weight with the token embedding (again after ``to_empty``, which unties them)."""
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))

    @torch.no_grad()
    def init_weights(self, seed: int | None = 0) -> None:
        """GPT-2's initialisation where the parameters are (normal 0.02, residual projections scaled by
        ``1/sqrt(2 L)``, zero biases, unit LayerNorms), drawn on their own device from a generator seeded with
        ``seed`` (``None``: the default generator, as under ``LazyInitContext``, which records the draws)."""
        gen = None if seed is None else torch.Generator(device=self.tok.weight.device).manual_seed(seed)
        scaled = 0.02 / math.sqrt(2 * max(1, self.shape.layers))
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                std = scaled if name.endswith((".proj", ".out")) else 0.02
                module.weight.normal_(0.0, std, generator=gen)
                bias = getattr(module, "bias", None)
                if bias is not None:
                    bias.zero_()
            elif isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
                module.bias.zero_()


def build(
    shape: GPTShape, device: torch.device | str, dtype: torch.dtype = torch.float32, seed: int = 0
) -> GPT:
    """The model built on the meta device, materialised in ``dtype`` directly on ``device`` and initialised there
    (nothing of its size ever exists on the host or in another dtype)."""
    with torch.device("meta"):
        model = GPT(shape)
    model.to(dtype=dtype)
    model.to_empty(device=device)
    model.tie()
    model.init_weights(seed)
    return model


def build_lazy(
    shape: GPTShape, device: torch.device | str, dtype: torch.dtype = torch.float32, seed: int = 0
) -> GPT:
    """The model built under :class:`stepforge.strategy.LazyInitContext` (nothing allocated): ``Booster.boost``
    materialises it where its plugin keeps it (``gemini``'s offloaded shards on the host), replaying the
    initialisation on ``device``; ``LazyInitContext.materialize`` puts it whole on ``device``."""
    from stepforge.strategy import LazyInitContext

    torch.manual_seed(seed)
    with LazyInitContext(default_device=device):
        model = GPT(shape)
        model.to(dtype=dtype)
        model.init_weights(None)
    return model


def random_batch(
    shape: GPTShape, batch: int, step: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch ``step``: uniform random tokens ``(batch, seq_len)`` and their next tokens, drawn on ``device``
    (the benches measure the training step, not a data pipeline)."""
    gen = torch.Generator(device=device).manual_seed(1_000_003 * (step + 1))
    rows = torch.randint(0, shape.vocab, (batch, shape.seq_len + 1), generator=gen, device=device)
    return rows[:, :-1], rows[:, 1:]
