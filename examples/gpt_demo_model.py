# SPDX-License-Identifier: Apache-2.0
"""The GPT demo's data and model (used by ``train_gpt_demo.py``): the stdlib's source as bytes, a byte-level GPT.

Kept free of ``torch.distributed`` so that the data, the model and the baseline can be read (and tested) alone.
"""

from __future__ import annotations

import math
import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Block", "ByteGPT", "generate", "load_corpus", "sample_batch", "unigram_bits_per_byte"]


def load_corpus(max_bytes: int) -> torch.Tensor:
    """The first ``max_bytes`` bytes of the stdlib's ``.py`` files (sorted paths, tests excluded): uint8, ``(n,)``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "test" in path.parts or "site-packages" in path.parts:
            continue
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).clone()


def unigram_bits_per_byte(data: torch.Tensor) -> float:
    """Entropy (bits) of the byte histogram of ``data`` (uint8, any shape): what a model that predicts every byte
    from the byte frequencies alone, ignoring context, scores at best. Uniform bytes give 8."""
    counts = torch.bincount(data.flatten().long(), minlength=256).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log2()).sum())


def sample_batch(
    corpus: torch.Tensor, seq_len: int, batch: int, seed: int, it: int, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch ``it`` of ``rank``: ``batch`` random windows of the corpus as int64 inputs ``(batch, seq_len)``
    and next-byte targets of the same shape. Seeded by ``(seed, it, rank)``: the data position is ``it``."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + it * 1_009 + rank)
    starts = torch.randint(0, corpus.numel() - seq_len - 1, (batch,), generator=g)
    rows = torch.stack([corpus[s : s + seq_len + 1] for s in starts.tolist()]).long()
    return rows[:, :-1], rows[:, 1:]


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a 4x MLP, each on a residual branch."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class ByteGPT(nn.Module):
    """Decoder-only transformer over bytes: int64 ``(batch, t <= ctx)`` -> logits ``(batch, t, 256)``.

    No weight tying, so every block shards on its own under FSDP/ZeRO.
    """

    def __init__(self, d: int, layers: int, heads: int, ctx: int) -> None:
        super().__init__()
        self.ctx = ctx
        self.tok, self.pos = nn.Embedding(256, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, 256, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


@torch.no_grad()
def generate(
    model: nn.Module, prompt: bytes, n: int, ctx: int, seed: int, device: torch.device | None = None
) -> bytes:
    """``prompt`` plus ``n`` bytes sampled top-k (k=20, temperature 0.8). Every rank runs it in lockstep (a
    sharded model gathers its parameters in forward). The model runs on ``device`` (default CPU); the sampling
    stays on the CPU with its seeded generator, so a seed gives the same draws on either device."""
    model.eval()
    g = torch.Generator().manual_seed(seed)
    idx = torch.tensor([list(prompt)], dtype=torch.long)
    for _ in range(n):
        logits = model(idx[:, -ctx:].to(device or "cpu"))[0, -1].float().cpu()
        top = torch.topk(logits, 20)
        probs = torch.softmax(top.values / 0.8, dim=-1)
        nxt = top.indices[torch.multinomial(probs, 1, generator=g)]
        idx = torch.cat([idx, nxt.view(1, 1)], dim=1)
    model.train()
    return bytes(idx[0].tolist())


#: nats per byte -> bits per byte
BITS_PER_NAT = 1 / math.log(2)
