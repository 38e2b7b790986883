# SPDX-License-Identifier: Apache-2.0
"""What ``bench_fused_gpu.py`` runs: the cases, their hyper-parameters and byte counts, the parameter shapes
and the :class:`Bundle` of params + grads every contender starts from.
"""

from __future__ import annotations

import argparse

import torch

__all__ = ["BYTES", "CASES", "DEVICE", "HP", "LAMB_HP", "Bundle", "gpt2_medium_shapes", "shape_sets"]


CASES = ("adam", "mixed", "sgd", "lamb")
BYTES = {"adam": 28, "mixed": 28, "sgd": 20, "lamb": 44}
HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
DEVICE = "cuda"  # the torch-only contenders also run on "cpu" (a dry run of this script's own logic)
LAMB_HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, max_grad_norm=1.0)


def gpt2_medium_shapes(layers: int = 24, d: int = 1024, vocab: int = 50257, ctx: int = 1024) -> list[tuple]:
    """Parameter shapes of GPT-2 medium (HF layout: c_attn / c_proj / c_fc Conv1D weights)."""
    shapes: list[tuple] = [(vocab, d), (ctx, d)]
    for _ in range(layers):
        shapes += [
            (d,),
            (d,),
            (d, 3 * d),
            (3 * d,),
            (d, d),
            (d,),
            (d,),
            (d,),
            (d, 4 * d),
            (4 * d,),
            (4 * d, d),
            (d,),
        ]
    return [*shapes, (d,), (d,)]


def shape_sets(args: argparse.Namespace) -> dict[str, list[tuple]]:
    if args.quick:
        return {
            "big": [(args.big_numel // 16,)],
            "gpt2m": gpt2_medium_shapes(layers=4),
            "small": [(1000,)] * 2000,
        }
    return {"big": [(args.big_numel,)], "gpt2m": gpt2_medium_shapes(), "small": [(1000,)] * 20_000}


class Bundle:
    """Params with grads attached, in ``dtype``, built from one seed so every contender starts the same."""

    def __init__(self, shapes: list[tuple], dtype: torch.dtype, seed: int = 0) -> None:
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        self.params = [
            torch.randn(s, device=DEVICE, generator=gen, dtype=torch.float32).to(dtype) for s in shapes
        ]
        for p in self.params:
            p.requires_grad_(True)
            p.grad = (torch.randn(p.shape, device=DEVICE, generator=gen) * 1e-2).to(dtype)

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)
