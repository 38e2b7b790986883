# SPDX-License-Identifier: Apache-2.0
"""A model built under ``LazyInitContext`` and boosted on CUDA (1 NCCL rank) gets the eager build's values where
its plugin keeps them: ``torch_fsdp`` on the device; ``gemini`` with ``placement_policy="auto"`` on the host,
its CPU-offloaded shards made there directly. FSDP2 refuses offloaded parameters on the device, and a model
that needs offloading would not fit there whole: the device's peak while boosting stays below a quarter of the
model's bytes (about one tensor at a time passes through it). Reference: the same GPT built eagerly on the CPU
under the same seed, compared bit for bit; then one training step gives a finite loss and moves every
parameter."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

PLUGINS = {
    "torch_fsdp": (dict(type="torch_fsdp", precision="fp32"), "cuda"),
    "gemini_auto": (dict(type="gemini", precision="fp32", placement_policy="auto"), "cpu"),
}


def _lazy_runs(rank: int, world: int) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from stepforge.strategy import Booster, LazyInitContext, get_accelerator, launch_from_torch
    from stepforge.strategy.memory.gpt import GPT, GPTShape

    launch_from_torch(seed=0)
    device = get_accelerator().get_current_device()
    shape = GPTShape(layers=4, d_model=256, heads=4, vocab=512, context=64)
    torch.manual_seed(3)
    eager = {k: v.clone() for k, v in GPT(shape).state_dict().items()}
    model_bytes = sum(v.numel() * v.element_size() for v in eager.values())
    out: dict = {"model_bytes": model_bytes}
    for name, (plugin, _) in PLUGINS.items():
        torch.manual_seed(3)
        with LazyInitContext():
            model = GPT(shape)
        booster = Booster(plugin=plugin)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        boosted, opt, *_ = booster.boost(model, dict(type="AdamW", lr=1e-3))
        peak = torch.cuda.max_memory_allocated() - base
        module = boosted.unwrap()
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = {k: v.clone() for k, v in get_model_state_dict(module, options=full).items()}
        tokens = torch.randint(0, shape.vocab, (2, shape.context), device=device)
        loss = boosted(tokens).float().square().mean()
        booster.backward(loss, opt)
        opt.step()
        after = get_model_state_dict(module, options=full)
        out[name] = {
            "peak": peak,
            "devices": sorted({p.to_local().device.type for p in module.parameters()}),
            "differ": sorted(k for k in eager if not torch.equal(eager[k], state[k])),
            "unmoved": sorted(k for k in eager if torch.equal(state[k], after[k])),
            "loss": float(loss.detach()),
        }
    return out


def test_lazy_models_materialise_where_each_plugin_keeps_them() -> None:
    from stepforge.testing.gpu import run_on_one_gpu

    got = run_on_one_gpu(_lazy_runs, timeout=300)
    for name, (_, where) in PLUGINS.items():
        run = got[name]
        assert run["differ"] == [] and run["devices"] == [where], (name, run)
        assert run["unmoved"] == [] and torch.isfinite(torch.tensor(run["loss"])), (name, run)
    # offloaded shards never pass through the device whole: about one tensor at a time does
    assert got["gemini_auto"]["peak"] < got["model_bytes"] / 4, got
