# SPDX-License-Identifier: Apache-2.0
"""LoRA under ``LowLevelZeroPlugin`` through the Booster, 2 gloo ranks, ColossalAI's pattern
(``tests/test_checkpoint_io/test_low_level_zero_checkpoint_io.py::check_low_level_zero_lora_checkpointIO``): a
tiny transformers Llama, the optimizer built over ``model.parameters()`` before ``Booster.enable_lora``,
ZeRO stage 2 with and without ``cpu_offload``, one fp16 step.

What is pinned: the plugin accepts LoRA (``support_lora``), the adapters train and the frozen base weights do not
move and get no master; the adapters saved with ``save_lora_as_pretrained`` and the model saved with
``save_model`` (sharded and not) load into a fresh model equal to the trained one; the fresh optimizer's masters
are this rank's pieces of its working parameters; the optimizer saved with ``save_optimizer`` (sharded and not)
loads into the fresh optimizer with an inner state equal to the trained one's.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist

from stepforge.core import build_optimizer
from stepforge.testing.distributed import requires_gloo, run_distributed

peft = pytest.importorskip("peft")  # in the strategy test group (it pulls transformers)
transformers = pytest.importorskip("transformers")


def _llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=16,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaModel(config)


def _equal_state(a: object, b: object) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal_state(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return type(a) is type(b) and a == b


def _booster(offload: bool):  # type: ignore[no-untyped-def]
    from stepforge.strategy import Booster
    from stepforge.zero import LowLevelZeroPlugin

    return Booster(plugin=LowLevelZeroPlugin(stage=2, max_norm=1.0, initial_scale=2**5, cpu_offload=offload))


def _case(rank: int, workdir: str, shard: bool, offload: bool) -> dict:
    from stepforge.zero import LowLevelZeroOptimizer

    lora = peft.LoraConfig(r=8, lora_alpha=32, lora_dropout=0.1, target_modules=["q_proj", "v_proj"])
    booster, new_booster = _booster(offload), _booster(offload)
    model = _llama()
    optimizer = build_optimizer(dict(type="HybridAdam", lr=1e-3), model.parameters())
    new_model = copy.deepcopy(model)
    new_optimizer = build_optimizer(dict(type="HybridAdam", lr=1e-3), new_model.parameters())
    model = booster.enable_lora(model, lora_config=lora)
    base_before = {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k}
    lora_before = {k: v.clone() for k, v in model.state_dict().items() if "lora_" in k}
    model, optimizer, *_ = booster.boost(model, optimizer)
    assert isinstance(optimizer, LowLevelZeroOptimizer)
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    masters_only_of_adapters = set(optimizer.working_to_master_param) == trainable
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))
    booster.backward(model(input_ids=ids).last_hidden_state.float().mean(), optimizer)
    optimizer.step()
    trained = {k: v.clone() for k, v in model.unwrap().state_dict().items()}

    tag = f"{int(shard)}{int(offload)}"
    adapter, weights, optim = (
        os.path.join(workdir, f"{name}-{tag}") for name in ("adapter", "model", "optim")
    )
    booster.save_lora_as_pretrained(model, adapter)
    booster.save_model(model, weights, shard=shard)
    booster.save_optimizer(optimizer, optim, shard=shard)
    dist.barrier()

    new_model = new_booster.enable_lora(new_model, pretrained_dir=adapter, lora_config=lora)
    new_model, new_optimizer, *_ = new_booster.boost(new_model, new_optimizer)
    assert isinstance(new_optimizer, LowLevelZeroOptimizer)
    adapters_loaded = _equal_state(model.state_dict(), new_model.state_dict())
    masters_are_pieces = True
    working = {id(p) for p in new_model.parameters()}
    for p_id, master in new_optimizer.working_to_master_param.items():
        param = new_optimizer.master_to_working_param[id(master)]
        padded = torch.nn.functional.pad(
            param.data.view(-1), (0, new_optimizer.get_param_padding_size(param))
        )
        piece = padded.chunk(dist.get_world_size())[dist.get_rank()]
        masters_are_pieces &= p_id in working and torch.equal(piece[: master.numel()], master.to(piece.dtype))
    new_booster.load_optimizer(new_optimizer, optim)
    optimizer_loaded = _equal_state(
        optimizer.optim.state_dict()["state"], new_optimizer.optim.state_dict()["state"]
    ) and bool(optimizer.optim.state)
    with torch.no_grad():  # so that only the load can bring the weights back
        for param in new_model.unwrap().parameters():
            param.zero_()
    new_booster.load_model(new_model, weights)
    model_loaded = _equal_state(trained, new_model.unwrap().state_dict())
    return {
        "masters_only_of_adapters": masters_only_of_adapters,
        # peft starts lora_B at zero, so the first step moves lora_B only
        "adapters_moved": all(not torch.equal(trained[k], v.to(trained[k].dtype)) for k, v in lora_before.items()
                              if "lora_B" in k),
        "base_kept": all(torch.equal(trained[k], v.to(trained[k].dtype)) for k, v in base_before.items()),
        "adapters_loaded": adapters_loaded,
        "masters_are_pieces": masters_are_pieces,
        "optimizer_loaded": optimizer_loaded,
        "model_loaded": model_loaded,
    }  # fmt: skip


def _all_cases(rank: int, world: int, workdir: str) -> dict:
    return {
        (shard, offload): _case(rank, workdir, shard, offload)
        for shard in (True, False)
        for offload in (False, True)
    }


@pytest.mark.distributed
@requires_gloo
def test_lora_under_zero2_trains_saves_and_loads_like_colossalai(tmp_path):
    for rank, cases in enumerate(run_distributed(_all_cases, 2, str(tmp_path), timeout=300)):
        for (shard, offload), checks in cases.items():
            failed = [name for name, ok in checks.items() if not ok]
            assert failed == [], (rank, shard, offload, failed)
