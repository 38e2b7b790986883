# SPDX-License-Identifier: Apache-2.0
"""``estimate``: a configuration's bytes per rank against a measured run, the peak's composition, the plugin
built as the Booster builds it (precision adopted or applied as autocast), the model forms it takes, the JSON and
the table, and bad arguments named."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stepforge.core import MemoryPlan
from stepforge.core.torch_compat import memory_tracker, tracker_bytes
from stepforge.strategy import Booster, Estimate, estimate
from stepforge.strategy.memory import ActivationTrace, make_plugin, resolve_model


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10))


def test_estimate_of_single_equals_a_measured_run() -> None:
    """``single`` with AdamW, two steps measured by MemTracker over every allocation: parameters, gradients and
    optimizer state after the step are the estimate's to the byte, the activations kept at the loss within 2%
    (the fake trace of ``mse_loss`` keeps one 1.3 KB temporary less), and the peak of the second step within 5%."""
    x, y = torch.randn(32, 64), torch.randn(32, 10)
    est = estimate(
        _mlp, "single", optimizer=dict(type="AdamW", lr=1e-3), inputs=x,
        criterion=lambda out: F.mse_loss(out, y), device="cpu",
    )  # fmt: skip
    tracker = memory_tracker()
    with tracker:
        booster = Booster(plugin="single")
        model, optimizer, *_ = booster.boost(_mlp(), dict(type="AdamW", lr=1e-3))
        booster.backward(F.mse_loss(model(x), y), optimizer)
        optimizer.step()
        optimizer.zero_grad()
        tracker.reset_mod_stats()
    base = tracker_bytes(tracker)["cpu"]["Total"]
    with tracker:
        loss = F.mse_loss(model(x), y)
        forward = tracker_bytes(tracker)["cpu"]["Total"] - base
        booster.backward(loss, optimizer)
        del loss
        optimizer.step()
        held = tracker_bytes(tracker)["cpu"]["Total"]
    peak = tracker_bytes(tracker, "peak")["cpu"]["Total"]
    params = sum(p.numel() * 4 for p in model.parameters())
    assert est.device["params"] == est.device["grads"] == params
    assert est.device["optimizer_state"] + est.host["optimizer_state"] == 2 * params + 6 * 4
    assert held == params * 4 + 6 * 4  # parameters, gradients, two moments, six step counters
    assert abs(est.device["activations"] - forward) <= 0.02 * forward
    assert abs(est.device["peak"] + est.host["peak"] - peak) <= 0.05 * peak


def test_peak_takes_the_larger_of_compute_and_update() -> None:
    """Forward/backward: what boost and the first step left, plus what lives through compute, plus the larger of
    the traced activations and the backward's own gradients and buffers; the step: the held bytes plus the
    update's buffers. A replicated layout's gradients come from the trace."""
    plan = MemoryPlan("x", 2, 0)
    plan.add("params", "device", 100, "p")
    plan.add("optimizer_state", "device", 200, "s", "step")
    plan.add("grads", "device", 50, "g", "grads")
    plan.add("buffers", "device", 30, "gathered", "compute")
    plan.add("buffers", "device", 40, "buckets", "reduce")
    plan.add("buffers", "device", 500, "table", "update")
    trace = ActivationTrace(forward=60, peak=80, peak_with_grads=120, grads=50)
    est = Estimate("x", {}, 2, 0, "fp32", None, "gloo", 1, plan, trace)
    assert est.peak("device") == max(300 + 30 + max(80, 50 + 40), 300 + 50 + 500)
    plan.tensors = [t for t in plan.tensors if t.lifetime != "update"]
    assert Estimate("x", {}, 2, 0, "fp32", None, "gloo", 1, plan, trace).device["peak"] == 300 + 30 + 90
    plan.full_grads = True
    assert Estimate("x", {}, 2, 0, "fp32", None, "gloo", 1, plan, trace).device["peak"] == 300 + 30 + 120
    assert (
        est.device["activations"] == 60 and est.device["params"] == 100 and est.after_boost["device"] == 100
    )


def test_estimate_of_an_accumulation_window_of_single_equals_a_measured_run() -> None:
    """``single`` with AdamW and 3 micro-batches per step, the second step measured by MemTracker: what is held
    between two micro-batches (parameters, the gradients summed so far, the state) is the estimate's to the byte,
    and the window's peak (a later micro-batch's activations on top of the full gradients) within 5%; it exceeds
    the estimate of one micro-batch per step, whose gradients only build up as the activations are freed."""
    x, y = torch.randn(512, 64), torch.randn(512, 10)  # activations above the step's temporaries
    common = dict(
        optimizer=dict(type="AdamW", lr=1e-3),
        inputs=x,
        criterion=lambda out: F.mse_loss(out, y),
        device="cpu",
    )
    est = estimate(_mlp, "single", accumulation_steps=3, **common)  # type: ignore[arg-type]
    one = estimate(_mlp, "single", **common)  # type: ignore[arg-type]
    tracker = memory_tracker()
    with tracker:
        booster = Booster(plugin="single")
        model, optimizer, *_ = booster.boost(_mlp(), dict(type="AdamW", lr=1e-3))

        def window(measure: bool) -> int:
            between = 0
            for i in range(3):
                tracker.reset_mod_stats()  # one forward per set of module statistics
                with booster.no_sync(model, optimizer):
                    booster.backward(F.mse_loss(model(x), y), optimizer)
                if i == 0:
                    between = tracker_bytes(tracker)["cpu"]["Total"]
            optimizer.step()
            optimizer.zero_grad()
            return between

        window(False)
    with tracker:  # entering again starts the peak here: the second window's
        between = window(True)
    peak = tracker_bytes(tracker, "peak")["cpu"]["Total"]
    assert est.window["device"] + est.window["host"] == between
    assert abs(est.peak(None) - peak) <= 0.05 * peak
    assert est.peak(None) > one.peak(None) and est.accumulation_steps == 3
    assert est.to_dict()["accumulation_steps"] == 3 and est.to_dict()["window"] == est.window


def test_peak_of_a_window_holds_its_gradients_beside_the_activations() -> None:
    """Accumulating, a later micro-batch's forward and backward hold the window's local gradients and the summed
    ones beside the activations (the traced peak without gradients); what is held between micro-batches is the
    state, the summed and the window's gradients; after the step the summed gradients remain, the window's do
    not."""
    plan = MemoryPlan("x", 2, 0, accumulation_steps=4)
    plan.add("params", "device", 100, "p")
    plan.add("optimizer_state", "device", 200, "s", "step")
    plan.add("grads", "device", 50, "sharded", "grads")
    plan.add("grads", "device", 70, "kept local", "window")
    plan.add("grads", "device", 5, "summed", "accumulated")
    plan.add("buffers", "device", 30, "gathered", "compute")
    plan.add("buffers", "device", 40, "buckets", "reduce")
    trace = ActivationTrace(forward=60, peak=80, peak_with_grads=120, grads=50)
    est = Estimate("x", {}, 2, 0, "fp32", None, "gloo", 1, plan, trace)
    first = 300 + 30 + max(80, 50 + 5 + 40)
    later = 300 + 5 + 70 + 30 + max(80, 50 + 40)
    assert est.device["peak"] == max(first, later, 300 + 50 + 5) == later
    assert est.window["device"] == 300 + 5 + 70
    assert est.device["grads"] == 55
    plan.accumulation_steps = 1
    assert Estimate("x", {}, 2, 0, "fp32", None, "gloo", 1, plan, trace).device["peak"] == first


def test_plugins_take_precision_as_the_booster_gives_it() -> None:
    """A plugin that applies precision adopts it (ZeRO, FSDP2); the others get the Booster's autocast; an explicit
    precision that differs is refused; keyword arguments reach the plugin."""
    zero, precision, autocast = make_plugin("zero2", precision="bf16", cpu_offload=True)
    assert (zero.name, precision, autocast, zero.config.cpu_offload) == ("zero2", "bf16", None, True)  # type: ignore[attr-defined]
    _ddp, precision, autocast = make_plugin("torch_ddp", device="cpu", precision="bf16")
    assert (precision, autocast) == ("bf16", torch.bfloat16)
    _, precision, autocast = make_plugin(dict(type="torch_fsdp", precision="fp32"), device="cpu")
    assert (precision, autocast) == ("fp32", None)
    with pytest.raises(ValueError, match="conflicts|explicit"):
        make_plugin(dict(type="zero2", precision="fp32"), precision="bf16")
    with pytest.raises(TypeError, match="instance"):
        make_plugin(zero, stage=1)


def test_models_as_modules_factories_and_transformers_configs() -> None:
    """A module is used as it is; a factory and a transformers config are built on the meta device."""
    from transformers import GPT2Config

    module = _mlp()
    assert resolve_model(module) is module
    built = resolve_model(_mlp)
    assert all(p.is_meta for p in built.parameters())
    gpt2 = resolve_model(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64))
    assert all(p.is_meta for p in gpt2.parameters())
    est = estimate(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64), device="cpu")
    assert est.parameters == sum(p.numel() for p in {id(p): p for p in gpt2.parameters()}.values())
    with pytest.raises(TypeError, match="nn.Module"):
        resolve_model(42)
    with pytest.raises(TypeError, match="factory"):
        resolve_model(lambda: 3)


def test_to_dict_is_json_with_device_host_and_collectives() -> None:
    """``to_dict()`` is JSON with per-component device and host bytes, the peak and the collectives; ``str()`` is
    the table naming the plugin."""
    est = estimate(
        _mlp, "zero2", world_size=4, precision="bf16", optimizer=dict(type="AdamW", lr=1e-3), device="cpu"
    )
    data = json.loads(json.dumps(est.to_dict()))
    for place in ("device", "host"):
        assert set(data[place]) == {
            "params",
            "grads",
            "master",
            "optimizer_state",
            "buffers",
            "activations",
            "peak",
        }
    assert data["collectives"]["all_to_all"]["calls"] >= 1 and data["world_size"] == 4
    assert "zero2" in str(est) and "device peak" in str(est)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(world_size=0), "world_size"),
        (dict(world_size=2, rank=2), "rank"),
        (dict(plugin="nope"), "nope"),
        (dict(accumulation_steps=0), "accumulation_steps"),
        (dict(accumulation_steps=2.0), "accumulation_steps"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict, match: str) -> None:
    """A world size below 1, a rank outside it, an unknown plugin, an accumulation count that is not an int
    >= 1: the error names the argument."""
    with pytest.raises(Exception, match=match):
        estimate(_mlp, device="cpu", **kwargs)
