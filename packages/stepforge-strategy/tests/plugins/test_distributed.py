# SPDX-License-Identifier: Apache-2.0
"""torch_ddp, torch_fsdp, gemini (and low_level_zero when stepforge-zero is installed) on 2 gloo processes.

One spawn runs every case (each spawn costs seconds on this machine):

- a small model trained 3 steps through Booster + ColossalAIOptimWrapper(accumulative_counts=2) equals the
  single-process fp32 AdamW run on the concatenated batch. Tolerances: ddp, fsdp and gemini (fp32) change
  only the reduction order: rtol 1e-4, atol 1e-5 on parameters after 3 AdamW steps (lr 1e-2);
- bf16 (FSDP2 param_dtype bf16, fp32 reduction and masters) tracks the fp32 run: parameters within 3e-2
  absolute; the Booster's bf16 autocast under DDP and gemini bf16 (CPU offload) within 3e-2; fp16 on FSDP2 within 1e-2; an fp16 overflow
  seen by one rank skips the step (and halves the scale) on both;
- gemini's ``max_norm`` (SGD, so clipping changes the step) equals torch's ``clip_grad_norm_`` run: rtol 1e-4,
  atol 1e-5;
- ``no_sync`` really skips synchronisation (DDP gradients differ between ranks inside it; FSDP2 sharded
  gradients stay unset), also with mmengine's forward-only ``optim_context``;
- ``TorchDDPPlugin(broadcast_buffers=...)`` keeps ColossalAI's meaning on torch versions that renamed the argument
  (True: rank 0's buffers at construction and every forward; False: every rank keeps its own), warning-free;
- save_model/save_optimizer after 3 steps, 2 more steps recorded; a fresh model loaded from the checkpoint at
  the same world size makes identical next steps (bitwise), and the parent process loads the same checkpoint at
  world size 1 (plugin ``single``) and matches within rtol 1e-4 / atol 1e-5.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from _cases import (
    MICRO,
    boost,
    boosted_steps,
    full_params,
    make_model,
    make_optimizer,
    micro_batch,
    reference_run,
    window,
)
from safetensors.torch import load_file

from stepforge.core import PLUGINS
from stepforge.strategy import Booster
from stepforge.testing.distributed import requires_gloo, run_distributed

K, STEPS, MORE = 2, 3, 2
CASES = [("torch_ddp", {}), ("torch_fsdp", {}), ("gemini", {"precision": "fp32", "placement_policy": "auto"})]
HAVE_ZERO = "low_level_zero" in PLUGINS
RESUME = ["torch_ddp", "torch_fsdp"]
if HAVE_ZERO:
    CASES.append(("low_level_zero", {"stage": 2, "precision": "fp32"}))
    RESUME.append("low_level_zero")


def _plugin(name, kwargs):
    return dict(type=name, **kwargs) if kwargs else name


def _all_cases(rank: int, world: int, ckpt: str) -> dict:
    out: dict = {"train": {}, "resume": {}, "default_plugin": type(Booster().plugin).__name__}
    for name, kwargs in CASES:
        _, model, wrapper = boost(_plugin(name, kwargs), k=K)
        losses = boosted_steps(model, wrapper, STEPS, rank, world, K)
        out["train"][name] = (full_params(wrapper.booster, model), losses)
    # bf16 through FSDP2's MixedPrecisionPolicy, precision taken from the Booster
    _, model, wrapper = boost("torch_fsdp", mixed_precision="bf16", k=K)
    assert wrapper.booster.plugin.precision == "bf16"
    losses = boosted_steps(model, wrapper, STEPS, rank, world, K)
    out["bf16"] = (full_params(wrapper.booster, model), losses)
    _, model, wrapper = boost(dict(type="gemini", precision="bf16", placement_policy="auto"), k=K)
    boosted_steps(model, wrapper, STEPS, rank, world, K)
    out["gemini_bf16"] = full_params(wrapper.booster, model)
    # booster.no_sync really skips the synchronisation: DDP grads stay local (they differ between ranks),
    # FSDP2 leaves the sharded grads unset until a synchronised backward reduce-scatters them
    x = torch.full((MICRO, 6), float(rank + 1))
    booster, model, wrapper = boost("torch_ddp")
    with booster.no_sync(model, wrapper.optimizer):
        booster.backward(model(x).sum(), wrapper.optimizer)
    local = torch.cat([p.grad.flatten() for p in model.parameters()])
    gathered = [torch.empty_like(local) for _ in range(world)]
    torch.distributed.all_gather(gathered, local)
    out["ddp_no_sync_differs"] = not torch.equal(gathered[0], gathered[1])
    booster, model, wrapper = boost("torch_fsdp")
    with booster.no_sync(model, wrapper.optimizer):
        booster.backward(model(x).sum(), wrapper.optimizer)
    out["fsdp_no_sync_unset"] = all(p.grad is None for p in model.parameters())
    booster.backward(model(x).sum(), wrapper.optimizer)
    out["fsdp_sync_set"] = all(p.grad is not None for p in model.parameters())
    # mmengine's pattern (only the forward inside optim_context) still skips FSDP2's reduce-scatter for the
    # non-final micro-batch, and the step is still exact
    booster, model, wrapper = boost("torch_fsdp", k=K)
    unset_after_first = []
    for step in range(STEPS):
        for m in range(K):
            x, y = micro_batch(step, m, rank, world, K)
            with wrapper.optim_context(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
            wrapper.update_params(loss)
            if m == 0:
                unset_after_first.append(all(p.grad is None for p in model.parameters()))
    out["fsdp_forward_only_context"] = (full_params(booster, model), all(unset_after_first))
    # the Booster's bf16 autocast under DDP (a plugin without precision)
    _, model, wrapper = boost("torch_ddp", mixed_precision="bf16", k=K)
    boosted_steps(model, wrapper, STEPS, rank, world, K)
    out["ddp_bf16"] = full_params(wrapper.booster, model)
    # fp16 on FSDP2: trains, and an overflow seen by rank 0 alone skips the step on both ranks
    booster, model, wrapper = boost("torch_fsdp", mixed_precision="fp16", k=K)
    boosted_steps(model, wrapper, STEPS, rank, world, K)
    out["fsdp_fp16"] = full_params(booster, model)
    opt = wrapper.optimizer
    x = torch.ones(MICRO, 6)
    opt.backward(model(x).float().mean())
    if rank == 0:
        next(p for p in model.parameters() if p.grad._local_tensor.numel()).grad._local_tensor[0] = float(
            "inf"
        )
    before = [p._local_tensor.clone() for p in model.parameters()]
    scale = opt.loss_scale
    opt.step()
    opt.zero_grad()
    unchanged = all(torch.equal(p._local_tensor, b) for p, b in zip(model.parameters(), before, strict=True))
    out["fp16_skip"] = (opt.last_step_skipped, unchanged, scale, opt.loss_scale)
    # gemini's max_norm: global-norm clipping over every shard inside step (SGD: clipping changes the step)
    _, model, wrapper = boost(dict(type="gemini", precision="fp32", max_norm=0.05), k=K, optimizer="SGD")
    boosted_steps(model, wrapper, STEPS, rank, world, K)
    out["gemini_clip"] = full_params(wrapper.booster, model)
    out["ddp_buffers"] = {sync: _ddp_buffer_sync(sync, rank) for sync in (True, False)}
    # checkpoint -> resume at the same world size
    for name in RESUME:
        booster, model, wrapper = boost(_plugin(name, dict(CASES)[name]), k=K)
        boosted_steps(model, wrapper, STEPS, rank, world, K)
        booster.save_model(model, f"{ckpt}/{name}/model", shard=True, use_safetensors=True)
        booster.save_optimizer(wrapper.optimizer, f"{ckpt}/{name}/optim")
        boosted_steps(model, wrapper, MORE, rank, world, K, first_step=STEPS)
        expected = full_params(booster, model)
        booster2, model2, wrapper2 = boost(_plugin(name, dict(CASES)[name]), k=K)
        booster2.load_model(model2, f"{ckpt}/{name}/model")
        booster2.load_optimizer(wrapper2.optimizer, f"{ckpt}/{name}/optim")
        boosted_steps(model2, wrapper2, MORE, rank, world, K, first_step=STEPS)
        got = full_params(booster2, model2)
        for key in expected:
            assert torch.equal(got[key], expected[key]), (name, key)
        out["resume"][name] = expected
    return out


class _Counted(torch.nn.Module):
    """A linear layer and a buffer the forward does not touch (it only moves when DDP syncs it)."""

    def __init__(self, value: float) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(6, 2)
        self.register_buffer("mark", torch.full((3,), value))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def _ddp_buffer_sync(sync: bool, rank: int) -> tuple[list[float], list[float], list[str]]:
    """The buffer after boost and after one forward that follows a local change on rank 1, and the
    deprecation warnings that torch raised while the plugin built DDP."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, *_ = Booster(plugin=dict(type="torch_ddp", broadcast_buffers=sync)).boost(_Counted(rank + 1.0))
    after_boost = model.unwrap().mark.tolist()
    if rank == 1:
        model.unwrap().mark.fill_(7.0)
    model(torch.ones(2, 6))
    deprecations = [
        str(w.message) for w in caught if issubclass(w.category, FutureWarning | DeprecationWarning)
    ]
    return after_boost, model.unwrap().mark.tolist(), deprecations


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("ckpt"))
    per_rank = run_distributed(_all_cases, 2, ckpt, timeout=300)
    return per_rank[0], ckpt, per_rank


@requires_gloo
@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_plugin_matches_single_process_fp32(results, name):
    params, losses = results[0]["train"][name]
    ref, _ = reference_run(STEPS, rows=2 * K * MICRO)
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(params[key], value, rtol=1e-4, atol=1e-5, msg=f"{name}: {key}")
    assert len(losses) == STEPS


@requires_gloo
def test_low_level_zero_case_is_present_when_installed():
    if not HAVE_ZERO:
        pytest.skip("stepforge-zero is not installed in this venv (low_level_zero comes from it)")
    assert "low_level_zero" in [c[0] for c in CASES]


@requires_gloo
def test_bf16_tracks_fp32(results):
    params, _ = results[0]["bf16"]
    ref, _ = reference_run(STEPS, rows=2 * K * MICRO)
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(params[key], value, rtol=0, atol=3e-2, msg=key)
    worst = max((params[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    assert worst > 0  # bf16 compute really ran


@requires_gloo
@pytest.mark.parametrize(
    "name", ["torch_ddp", "torch_fsdp"]
)  # torch's DCP optimizer layout, loaded by `single`
def test_checkpoint_loads_at_world_size_one(results, name):
    out, ckpt, _ = results
    expected = out["resume"][name]
    # the HF-layout file loads into a plain module
    plain = make_model(seed=9)
    state = {}
    for f in sorted((__import__("pathlib").Path(ckpt) / name / "model").glob("*.safetensors")):
        state.update(load_file(str(f)))
    plain.load_state_dict(state)
    # resume on one process, the window of both ranks as 2*K micro-batches
    booster, model, wrapper = boost("single", k=2 * K)
    booster.load_model(model, f"{ckpt}/{name}/model")
    booster.load_optimizer(wrapper.optimizer, f"{ckpt}/{name}/optim")
    for p, q in zip(plain.parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q)
    boosted_steps(model, wrapper, MORE, 0, 1, 2 * K, first_step=STEPS)
    for key, value in model.unwrap().state_dict().items():
        torch.testing.assert_close(value, expected[key], rtol=1e-4, atol=1e-5, msg=key)


@requires_gloo
def test_precisions_on_ddp_and_fsdp(results):
    out = results[0]
    ref, _ = reference_run(STEPS, rows=2 * K * MICRO)
    for case, bound in (("ddp_bf16", 3e-2), ("fsdp_fp16", 1e-2), ("gemini_bf16", 3e-2)):
        worst = max((out[case][k] - v).abs().max().item() for k, v in ref.state_dict().items())
        assert 0 < worst <= bound, (case, worst)
    for rank_out in results[2]:  # rank 0 injected the inf; rank 1 must skip too
        skipped, unchanged, scale, new_scale = rank_out["fp16_skip"]
        assert skipped and unchanged and new_scale == scale / 2


@requires_gloo
def test_gemini_max_norm_clips_by_the_global_norm(results):
    model = make_model()
    opt = make_optimizer(model.parameters(), "SGD")
    for step in range(STEPS):
        x, y = window(step, 2 * K * MICRO)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        assert torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05) > 0.05  # clipping is active
        opt.step()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(results[0]["gemini_clip"][key], value, rtol=1e-4, atol=1e-5, msg=key)


@requires_gloo
def test_no_sync_skips_synchronisation(results):
    for rank_out in results[2]:
        assert rank_out["ddp_no_sync_differs"]
        assert rank_out["fsdp_no_sync_unset"] and rank_out["fsdp_sync_set"]


@requires_gloo
def test_default_plugin_under_a_process_group_is_ddp(results):
    assert results[0]["default_plugin"] == "TorchDDPPlugin"


@requires_gloo
def test_forward_only_optim_context_still_skips_fsdp_sync(results):
    params, skipped = results[0]["fsdp_forward_only_context"]
    assert skipped
    ref, _ = reference_run(STEPS, rows=2 * K * MICRO)
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(params[key], value, rtol=1e-4, atol=1e-5, msg=key)


@requires_gloo
def test_ddp_broadcast_buffers_keeps_colossalai_meaning_without_deprecation(results):
    # True: rank 0's buffers at construction and before every forward; False: every rank keeps its own, at
    # construction too (torch < 2.12's broadcast_buffers=False; forward_sync_buffers=False would sync once)
    _, _, per_rank = results
    expected = {
        True: ([[1.0] * 3, [1.0] * 3], [[1.0] * 3, [1.0] * 3]),
        False: ([[1.0] * 3, [2.0] * 3], [[1.0] * 3, [7.0] * 3]),
    }
    for sync, (after_boost, after_forward) in expected.items():
        got = [r["ddp_buffers"][sync] for r in per_rank]
        assert [g[0] for g in got] == after_boost, sync
        assert [g[1] for g in got] == after_forward, sync
        assert [g[2] for g in got] == [[], []], sync
