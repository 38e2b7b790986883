# SPDX-License-Identifier: Apache-2.0
"""GPT shapes to estimate by name (``stepforge-estimate gpt-7b``): a plain pre-norm decoder, built on the meta
device.

========== ======= ======== ======= ======= ======================
name        layers  d_model  heads   vocab   parameters
========== ======= ======== ======= ======= ======================
``gpt-1.3b``   24     2048      16   50304   1.42 B (GPT-3 XL shape)
``gpt-7b``     32     4096      32   50304   6.86 B
``gpt-70b``    80     8192      64   50304   65.3 B
========== ======= ======== ======= ======= ======================

Each block holds ``12 d^2 + 13 d`` parameters (fused QKV, output projection, a 4x MLP, two LayerNorms); the
token and position embeddings and the output head (untied, so every block shards on its own) add
``2 V d + C d``; the context ``C`` is 2048.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT_SHAPES", "GPTShape", "GPT", "gpt"]


@dataclass(frozen=True)
class GPTShape:
    """A GPT's dimensions."""

    layers: int
    d_model: int
    heads: int
    vocab: int = 50304
    context: int = 2048

    @property
    def parameters(self) -> int:
        """The parameter count of :class:`GPT` of this shape."""
        d = self.d_model
        block = 12 * d * d + 13 * d
        return self.layers * block + 2 * self.vocab * d + self.context * d + 2 * d


#: the named shapes the command and the "What fits" page use
GPT_SHAPES: dict[str, GPTShape] = {
    "gpt-1.3b": GPTShape(24, 2048, 16),
    "gpt-7b": GPTShape(32, 4096, 32),
    "gpt-70b": GPTShape(80, 8192, 64),
}


class _Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        out: torch.Tensor = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return out


class GPT(nn.Module):
    """Decoder-only transformer: int64 tokens ``(batch, t <= context)`` -> logits ``(batch, t, vocab)``."""

    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        self.shape = shape
        self.tok = nn.Embedding(shape.vocab, shape.d_model)
        self.pos = nn.Embedding(shape.context, shape.d_model)
        self.blocks = nn.ModuleList(_Block(shape.d_model, shape.heads) for _ in range(shape.layers))
        self.ln_f = nn.LayerNorm(shape.d_model)
        self.head = nn.Linear(shape.d_model, shape.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.ln_f(x))
        return logits


def gpt(name: str) -> GPT:
    """The named GPT (:data:`GPT_SHAPES`) on the meta device (no memory).

    Raises:
        KeyError: an unknown name (the message lists the known ones).
    """
    if name not in GPT_SHAPES:
        raise KeyError(f"unknown GPT shape {name!r}; known: {', '.join(GPT_SHAPES)}.")
    with torch.device("meta"):
        return GPT(GPT_SHAPES[name])
