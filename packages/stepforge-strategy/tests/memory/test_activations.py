# SPDX-License-Identifier: Apache-2.0
"""Activations traced on fake tensors equal what a real forward and backward keep (counted by the same
MemTracker on real tensors), under autocast and in a cast dtype too; the model is left untouched; losses come
from the output, a ``loss`` entry or a criterion; a forward that reads values is traced on real tensors (or
refused with the reason when only fake tensors are allowed); activation checkpointing is traced as it runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stepforge.core.torch_compat import memory_tracker, tracker_bytes
from stepforge.strategy.memory import trace_activations
from stepforge.strategy.memory._activations import split_inputs


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(50, 16)
        self.fc1, self.fc2 = nn.Linear(16, 64), nn.Linear(64, 50)
        self.norm = nn.LayerNorm(16)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(F.gelu(self.fc1(self.norm(self.emb(tokens)))))
        return out


def _measured(model: nn.Module, tokens: torch.Tensor, autocast: torch.dtype | None) -> tuple[int, int]:
    """What a real forward keeps when the loss is computed, and the most activations and temporaries alive (the
    output dropped before backward)."""
    tracker = memory_tracker()
    tracker.track_external(model)
    with tracker:
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            out = model(tokens)
        loss = out.float().mean()
        snap = tracker_bytes(tracker)["cpu"]
        forward = snap["Activation"] + snap.get("Temp", 0)
        del out  # as a training loop does: the loss lives through backward, the output does not
        loss.backward()
    peak = tracker_bytes(tracker, "peak")["cpu"]
    return forward, peak["Activation"] + peak["Temp"]


@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_trace_equals_a_real_forward_and_backward(autocast: torch.dtype | None) -> None:
    """Bytes kept at the loss and the peak of activations and temporaries: the fake trace's equal the real run's
    (fp32, and under bf16 autocast with its cached weight casts)."""
    tokens = torch.randint(0, 50, (8, 12))
    trace = trace_activations(_Tiny(), tokens, autocast_dtype=autocast)
    forward, peak = _measured(_Tiny(), tokens, autocast)
    assert trace.forward == forward > 0
    assert trace.peak == max(forward, peak)
    assert trace.grads == sum(p.numel() * 4 for p in _Tiny().parameters())


class _Tied(_Tiny):
    """``_Tiny`` with its head tied to the embedding (one parameter registered in two modules, as GPT-2's and
    T5's heads are)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc2 = nn.Linear(64, 16)
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(super().forward(tokens))


@pytest.mark.parametrize("method", ["fake", "real"])
def test_tied_parameters_get_one_gradient(method: str) -> None:
    """A tied parameter is one tensor in the traced copy, as in the model: one gradient for it (the untied fake
    copy built one per module, and the gradients it counted were the tied embedding's bytes over), and the
    real forward and backward's activations."""
    tokens = torch.randint(0, 50, (8, 12))
    model = _Tied()
    trace = trace_activations(model, tokens, method=method)
    forward, peak = _measured(_Tied(), tokens, None)
    assert trace.grads == sum(p.numel() * 4 for p in model.parameters())  # each parameter once
    assert trace.forward == forward and trace.peak == max(forward, peak)


def test_trace_in_the_plugins_compute_dtype_halves_the_activations() -> None:
    """Parameters and floating inputs cast to bf16 (as ZeRO and FSDP2 cast them): every saved tensor is half the
    bytes of the fp32 run (the loss, a 4-byte fp32 scalar either way, aside); the model itself keeps its fp32
    parameters and no gradients."""
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))
    x = torch.randn(16, 32)
    fp32 = trace_activations(model, x)
    bf16 = trace_activations(model, x, compute_dtype=torch.bfloat16)
    assert (bf16.forward - 4) * 2 == fp32.forward - 4
    assert all(p.dtype == torch.float32 and p.grad is None for p in model.parameters())


def test_meta_model_and_meta_inputs_are_traced_like_real_ones() -> None:
    """A model built on the meta device and a meta batch give the real ones' numbers."""
    tokens = torch.randint(0, 50, (4, 6))
    with torch.device("meta"):
        meta = _Tiny()
    meta_tokens = torch.empty((4, 6), dtype=torch.int64, device="meta")
    assert trace_activations(meta, meta_tokens) == trace_activations(_Tiny(), tokens)


def test_losses_from_a_loss_entry_or_a_criterion() -> None:
    """A dict output with ``loss`` uses it; a criterion replaces the mean; a tuple's first floating tensor."""

    class _WithLoss(_Tiny):
        def forward(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:  # type: ignore[override]
            logits = super().forward(tokens)
            return {"logits": logits, "loss": logits.logsumexp(-1).mean()}

    tokens = torch.randint(0, 50, (4, 6))
    assert trace_activations(_WithLoss(), tokens).forward > trace_activations(_Tiny(), tokens).forward
    targets = torch.randint(0, 50, (4, 6))
    with_ce = trace_activations(
        _Tiny(), tokens, criterion=lambda out: F.cross_entropy(out.flatten(0, 1), targets.flatten())
    )
    assert with_ce.forward > trace_activations(_Tiny(), tokens).forward  # cross-entropy saves its softmax


class _Reads(nn.Module):
    """A forward that reads a value (``.item()``) and routes by value (a data-dependent shape), as MoE does."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.expert = nn.Linear(16, 16), nn.Linear(16, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x) * float(x.sum().item() > 0)
        routed = h[h[:, 0] > 0]  # the rows this "expert" takes
        out: torch.Tensor = self.expert(routed).sum() + h.sum()
        return out


def test_a_forward_that_reads_values_is_traced_on_real_tensors() -> None:
    """``.item()`` and a data-dependent shape cannot run on fake tensors: ``method="fake"`` refuses with the
    reason and the way out; the default traces on real CPU tensors and counts what a real run of the same values
    keeps; ``method="real"`` does so directly."""
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match=r"\.item\(\).*trace='real'"):
        trace_activations(_Reads(), x, method="fake")
    auto = trace_activations(_Reads(), x)
    forward, peak = _measured(_Reads(), x, None)
    assert auto.method == "real"
    assert auto.forward == forward > 0
    assert auto.peak == max(forward, peak)
    assert trace_activations(_Reads(), x, method="real") == auto
    assert trace_activations(_Tiny(), torch.randint(0, 50, (8, 12))).method == "fake"
    with pytest.raises(ValueError, match="trace must be one of"):
        trace_activations(_Tiny(), x, method="meta")


def test_activation_checkpointing_keeps_only_the_blocks_inputs() -> None:
    """With ``activation_checkpointing`` each block's activations are recomputed in backward: the trace keeps at
    the loss what a real run of the model with its blocks under ``torch.utils.checkpoint`` keeps, less than
    without."""
    from torch.utils.checkpoint import checkpoint

    class _Stack(nn.Module):
        def __init__(self, wrap: bool = False) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.blocks = nn.ModuleList(
                nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(3)
            )
            self.wrap = wrap

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = checkpoint(block, x, use_reentrant=False) if self.wrap else block(x)
            return x

    x = torch.randn(32, 16)
    plain = trace_activations(_Stack(), x)
    ckpt = trace_activations(_Stack(), x, activation_checkpointing=True)
    forward, _ = _measured(_Stack(wrap=True), x, None)
    assert ckpt.forward == forward < plain.forward
    assert trace_activations(_Stack(wrap=True), x).forward == forward  # a model that checkpoints itself


def test_split_inputs() -> None:
    """A tensor is one argument, a tuple the arguments, a dict the keyword arguments."""
    x = torch.zeros(1)
    assert split_inputs(x) == ((x,), {})
    assert split_inputs((x, x)) == ((x, x), {})
    assert split_inputs({"input_ids": x}) == ((), {"input_ids": x})
