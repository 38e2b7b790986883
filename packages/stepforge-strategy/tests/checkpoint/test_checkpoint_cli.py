# SPDX-License-Identifier: Apache-2.0
"""``stepforge-checkpoint``: ``inspect`` shows what a checkpoint is and verifies it; ``export`` turns any stepforge
model checkpoint into one Hugging Face directory that ``AutoModelForCausalLM.from_pretrained`` loads.

Round trips (one launch of 2 gloo ranks): a GPT-2 trained under ``torch_fsdp`` and a Llama under ``zero2``, saved
as Strategy checkpoints (DCP), as ``Booster.save_model`` ``.bin`` shards and as one safetensors file; each export
loads with ``from_pretrained`` and equals the trained model's full state dict tensor for tensor, logits too. A
damaged file, an optimizer save, an occupied OUT and a missing config are refused or reported in one line, and
nothing is written; a DCP directory torch wrote (no manifest) is read, shown as not verified.
The peak memory of an export of a 9-shard checkpoint stays under 2 shards (measured in a fresh process)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from _strategy_cases import full_params, make_strategy

transformers = pytest.importorskip("transformers")

from stepforge.strategy.checkpoint._dcp import save_dir  # noqa: E402
from stepforge.strategy.checkpoint.cli import main  # noqa: E402
from stepforge.testing.distributed import requires_gloo, run_distributed  # noqa: E402

PROG = "stepforge-checkpoint: error: "


def _gpt2_config():
    return transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=16, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0
    )


def _llama_config():
    return transformers.LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=64, max_position_embeddings=32,
    )  # fmt: skip


def _tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(seed))


def _train(rank: int, work: str, plugin: str, config) -> dict[str, torch.Tensor]:
    """Three optimizer steps under ``plugin`` through Strategy, then a Strategy checkpoint; rank 0 returns the
    trained model's full state dict (gathered by torch, not by the code under test)."""
    from stepforge.core import WrappedModel

    torch.manual_seed(0)
    strategy = make_strategy(work, plugin=dict(type=plugin, precision="fp32"))
    model, wrapper = strategy.prepare(
        transformers.AutoModelForCausalLM.from_config(config),
        optim_wrapper=dict(optimizer=dict(type="AdamW", lr=0.05)),
    )[:2]
    for it in range(3):
        x = _tokens(10 * it + rank)
        with wrapper.optim_context(model):
            loss = model(input_ids=x, labels=x).loss
        wrapper.update_params(loss)
    strategy.save_checkpoint("ckpt")
    full = full_params(model.unwrap() if isinstance(model, WrappedModel) else model)
    return {"model": model, "booster": strategy.booster, "full": full}


def _round_trip_ranks(rank: int, world: int, work: str) -> dict[str, dict[str, torch.Tensor]]:
    fsdp = _train(rank, os.path.join(work, "fsdp"), "torch_fsdp", _gpt2_config())
    # Booster saves of the same model: one safetensors file
    fsdp["booster"].save_model(fsdp["model"], os.path.join(work, "single.safetensors"), use_safetensors=True)
    zero = _train(rank, os.path.join(work, "zero2"), "zero2", _llama_config())
    # .bin shards with their index into a directory that already holds config.json (the HF workflow)
    zero["booster"].save_model(zero["model"], os.path.join(work, "shards"), shard=True, size_per_shard=0.01)
    return {"fsdp": fsdp["full"], "zero2": zero["full"]} if rank == 0 else {}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    pytest.importorskip("stepforge.zero")
    work = tmp_path_factory.mktemp("trained")
    _gpt2_config().save_pretrained(str(work / "gpt2-config"))
    _llama_config().save_pretrained(str(work / "shards"))
    return work, run_distributed(_round_trip_ranks, 2, str(work), timeout=240)[0]


def _assert_loads_as(out, full: dict[str, torch.Tensor], config) -> None:
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    state = loaded.state_dict()
    assert state.keys() == full.keys()
    for key, tensor in full.items():
        assert torch.equal(state[key], tensor), key
    reference = transformers.AutoModelForCausalLM.from_config(config).eval()
    reference.load_state_dict(full)
    x = _tokens(99)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=x).logits, reference(input_ids=x).logits)


@requires_gloo
@pytest.mark.distributed
@pytest.mark.parametrize(
    "case, source, config, cap",
    [
        ("fsdp", "fsdp/ckpt", "gpt2-config", "10KB"),  # several shards
        ("fsdp", "single.safetensors", "gpt2-config/config.json", None),
        ("zero2", "zero2/ckpt", "shards", None),
        ("zero2", "shards", None, "10KB"),  # the save's own config.json
    ],
)
def test_export_loads_with_from_pretrained_and_equals_the_trained_model(
    trained, tmp_path, case, source, config, cap
):
    work, full = trained
    out = tmp_path / "hf"
    argv = ["export", str(work / source), str(out)]
    argv += ["--config", str(work / config)] if config else []
    argv += ["--max-shard-size", cap] if cap else []
    assert main(argv) == 0
    _assert_loads_as(out, full[case], _gpt2_config() if case == "fsdp" else _llama_config())
    assert main(["inspect", str(out)]) == 0  # the export carries its own COMMIT.json
    if cap is None:
        assert "model.safetensors" in os.listdir(out)
        return
    # as transformers names and fills shards: a new shard only when the next tensor would pass the cap
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2 and shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                                          for i in range(1, len(shards) + 1)]  # fmt: skip
    assert set(index["weight_map"]) == set(full[case])
    sizes = [os.path.getsize(out / s) for s in shards]
    assert max(sizes[:-1]) <= int(cap[:-2]) * 1000 + 4096  # + the safetensors header


@requires_gloo
@pytest.mark.distributed
def test_inspect_shows_plugin_world_size_step_and_verified_files(trained, capsys):
    work, _ = trained
    for plugin in ("torch_fsdp", "zero2"):
        path = work / ("fsdp" if plugin == "torch_fsdp" else "zero2") / "ckpt"
        assert main(["inspect", str(path), "--json"]) == 0
        info = json.loads(capsys.readouterr().out)
        record = json.loads((path / "COMMIT.json").read_text())
        assert (info["kind"], info["plugin"], info["world_size"], info["iter"]) == (
            "Strategy checkpoint (DCP)", plugin, 2, 3,
        )  # fmt: skip
        assert info["verified"] and info["manifest"] == "COMMIT.json"
        assert {f["name"]: (f["size"], f["crc32"]) for f in info["files"]} == {
            n: (r["size"], r["crc32"]) for n, r in record["files"].items()
        }
        assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= {f["name"] for f in info["files"]}
        assert main(["inspect", str(path)]) == 0
        table = capsys.readouterr().out
        assert f"plugin      {plugin}" in table and "world size  2" in table and "iter 3" in table
        assert "CRC-32 verified against COMMIT.json" in table


def _gpt2_checkpoint(path) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    state = transformers.GPT2LMHeadModel(_gpt2_config()).state_dict()
    save_dir(str(path), tensors={"model": state}, objects={}, rank_objects={}, meta={"iter": 5})
    return state


def test_a_damaged_file_is_one_line_exit_2_and_nothing_is_written(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    _gpt2_checkpoint(ckpt)
    data = bytearray((ckpt / "__0_0.distcp").read_bytes())
    data[len(data) // 2] ^= 0x01
    (ckpt / "__0_0.distcp").write_bytes(bytes(data))
    for argv in (["export", str(ckpt), str(tmp_path / "out")], ["inspect", str(ckpt)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(PROG) and err.count("\n") == 1, err
        assert "__0_0.distcp" in err and "CRC-32" in err and "nothing was written" in err
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no OUT, no temporary directory


def test_out_is_refused_when_occupied_replaced_with_overwrite_and_never_the_source(tmp_path, capsys):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    state = _gpt2_checkpoint(ckpt)
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    assert main(["export", str(ckpt), str(out)]) == 2
    assert "not empty" in capsys.readouterr().err and os.listdir(out) == ["mine.txt"]
    assert main(["export", str(ckpt), str(out), "--overwrite"]) == 0
    assert "no config.json" in capsys.readouterr().err  # written, and said why from_pretrained needs --config
    assert sorted(os.listdir(out)) == ["COMMIT.json", "model.safetensors"]
    from safetensors.torch import load_file

    assert load_file(str(out / "model.safetensors")).keys() == state.keys()
    assert main(["export", str(ckpt), str(tmp_path), "--overwrite"]) == 2  # would delete the checkpoint
    assert "holds the checkpoint" in capsys.readouterr().err and (ckpt / "COMMIT.json").is_file()
    assert main(["export", str(ckpt), str(tmp_path / "x"), "--config", str(tmp_path / "nope.json")]) == 2
    assert "--config" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_an_optimizer_save_is_refused_and_a_foreign_dcp_directory_is_read_unverified(tmp_path, capsys):
    from stepforge.strategy import Booster

    model = transformers.GPT2LMHeadModel(_gpt2_config())
    booster = Booster(plugin="single")
    _, optimizer, *_ = booster.boost(model, torch.optim.AdamW(model.parameters()))
    booster.save_optimizer(optimizer, str(tmp_path / "optim"))  # one file (shard=False, the default)
    booster.save_optimizer(optimizer, str(tmp_path / "optim_dcp"), shard=True)  # a DCP directory
    for saved in ("optim", "optim_dcp"):
        assert main(["export", str(tmp_path / saved), str(tmp_path / "out")]) == 2
        assert (
            "optimizer save, not model weights" in capsys.readouterr().err and not (tmp_path / "out").exists()
        )
    import torch.distributed.checkpoint as dcp

    dcp.save(model.state_dict(), storage_writer=dcp.FileSystemWriter(str(tmp_path / "plain")), no_dist=True)
    assert main(["inspect", str(tmp_path / "plain"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["kind"], info["verified"], info["world_size"]) == ("DCP directory", False, 1)
    assert info["model_tensors"] == len(model.state_dict())


def test_a_plain_torch_file_with_a_prefix_exports_cast_and_renamed(tmp_path):
    """A ``torch.save`` of a compiled model's state (``_orig_mod.``; tied weights share storage), not written by
    stepforge (no manifest: read as it is, weights_only), exported as bfloat16 with the prefix stripped."""
    torch.manual_seed(2)
    model = transformers.GPT2LMHeadModel(_gpt2_config())
    state = model.state_dict()
    torch.save({f"_orig_mod.{k}": v for k, v in state.items()}, tmp_path / "model.pt")
    model.config.save_pretrained(str(tmp_path / "cfg"))
    argv = ["export", str(tmp_path / "model.pt"), str(tmp_path / "out"), "--config", str(tmp_path / "cfg"),
            "--dtype", "bfloat16", "--strip-prefix", "_orig_mod."]  # fmt: skip
    assert main(argv) == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.bfloat16)
    got = loaded.state_dict()
    for key, tensor in state.items():
        assert got[key].dtype == torch.bfloat16 and torch.equal(got[key], tensor.to(torch.bfloat16)), key


_MEASURE = """
import resource, runpy, sys
import safetensors.torch
from stepforge.strategy.checkpoint.cli import main
assert main(["inspect", sys.argv[2]]) == 0  # imports and first-use set-up of the readers, the checksums read
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
sys.argv = ["stepforge-checkpoint", *sys.argv[1:]]
try:
    runpy.run_module("stepforge.strategy.checkpoint.cli", run_name="__main__")
except SystemExit as exc:
    assert exc.code == 0, exc.code
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


def test_export_peak_memory_is_about_one_shard(tmp_path):
    """136 MiB of weights (1 MiB tensors) exported in 16 MiB shards: the peak RSS of the exporting process grows
    by less than two shards (measured 17.7-18.8 MiB); reading whole would take 136 MiB."""
    g = torch.Generator().manual_seed(0)
    state = {f"layers.{i}.weight": torch.randn(512, 512, generator=g) for i in range(136)}
    save_dir(str(tmp_path / "ckpt"), tensors={"model": state}, objects={}, rank_objects={}, meta={})
    del state
    argv = ["export", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--max-shard-size", "16MiB"]
    try:
        run = subprocess.run(
            [sys.executable, "-c", _MEASURE, *argv], capture_output=True, text=True, timeout=300
        )
        assert run.returncode == 0, run.stderr[-3000:]
        growth = int(run.stdout.strip().splitlines()[-1])
        index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    finally:  # 270 MiB: not left for pytest's kept temporary directories
        shutil.rmtree(tmp_path, ignore_errors=True)
    assert len(set(index["weight_map"].values())) == 9 and len(index["weight_map"]) == 136
    assert growth < 2 * 16 * 2**20, f"peak RSS grew by {growth / 2**20:.1f} MiB"
