# SPDX-License-Identifier: Apache-2.0
"""``compile=`` through the Booster for every plugin on 2 gloo ranks, against the same run in eager mode.

One launch runs every case (each launch costs seconds of start-up, each cold Inductor compile tens of seconds on
2 cores): per plugin (``single``, ``torch_ddp``, ``torch_fsdp``, ``gemini``, ``zero1``, ``zero2``), 20 optimizer
steps of 2 accumulated micro-batches through ``ColossalAIOptimWrapper``, eager and compiled, in

- fp32 with Inductor (the default backend): each window's loss within a relative 1e-5 of the eager run's.
  Inductor fuses the LayerNorm/GELU/residual pointwise and reduction code into generated C++ kernels and sums in
  another order, so the float32 results differ by a few ulp per op; measured here (torch 2.13 CPU) the largest
  relative loss difference over the 20 steps was 2.4e-7 (single), 1.6e-7 - 2.4e-7 (the others). A lost
  synchronisation moves the curve by far more than 1e-5: the unsynchronised ``single`` run differs from
  ``torch_ddp``'s by a relative 2.0 on the same data.
- mixed precision (``bf16``: the Booster's autocast for ``single``/``torch_ddp``, FSDP2's bf16 parameters for
  ``torch_fsdp``/``gemini``, bf16 working weights with fp32 masters for ZeRO) with the ``aot_eager`` backend:
  bit-identical losses. That backend captures the same graphs (dynamo + AOTAutograd's compiled backward, the
  autocast casts traced into them) but runs them with the eager kernels, so any difference is a wiring error.
  (Inductor's bf16 kernels keep fp32 intermediates and differ from eager by up to 8.4e-3 relative over these 20
  steps, as much as two eager bf16 plugins differ from each other, 6.5e-3: too loose to pin anything.)

A compile that did nothing would match eager exactly, so every compiled run also counts, through a counting
backend around the real one, that exactly one graph was compiled (both FSDP2 blocks share it) and that it ran at
every micro-batch (40 forwards; 80 for FSDP2, one per block), and that the compiled methods are the two FSDP2
blocks' ``forward`` (the root eager) for torch_fsdp/gemini and the root's ``forward`` otherwise. (Compiling the
root of an FSDP2 model instead gives the same counts here: dynamo skips the root frame at the loop over the
dynamo-disabled FSDP2 hooks and compiles the blocks' frames it calls.) ZeRO's gradient hooks and DDP's/FSDP2's
reductions run after the compiled backward: a missed reduction would break the loss match.

Checkpoints from compiled models (torch_fsdp through ``Booster.save_model``, zero2 through
``Strategy.save_checkpoint``): no ``_orig_mod.`` in their keys, they load into an eager model with the same
weights, and the eager model's checkpoint loads back into the compiled one, which keeps running compiled code.
"""

from __future__ import annotations

import glob
import os
import traceback
from typing import Any

import pytest
import torch
from _compile_cases import (
    STEPS,
    CountingBackend,
    K,
    boost_net,
    full_weights,
    make_net,
    max_relative_difference,
    train,
)
from safetensors import safe_open

from stepforge.core.torch_compat import SafeFileSystemReader
from stepforge.strategy import Strategy
from stepforge.strategy.compile import user_module
from stepforge.testing.distributed import requires_gloo, run_distributed

pytestmark = requires_gloo

FP32_TOLERANCE = 1e-5
#: name -> (fp32 plugin, (mixed-precision plugin, Booster mixed_precision)), compiled forwards per model forward
#: (FSDP2: one per block, the root's own code eager)
PLUGIN_CASES: dict[str, tuple[Any, tuple[Any, Any], int]] = {
    "single": ("single", ("single", "bf16"), 1),
    "torch_ddp": ("torch_ddp", ("torch_ddp", "bf16"), 1),
    "torch_fsdp": ("torch_fsdp", ("torch_fsdp", "bf16"), 2),
    "gemini": (
        dict(type="gemini", precision="fp32", placement_policy="auto"),
        (dict(type="gemini", precision="bf16", placement_policy="auto"), None),
        2,
    ),
    "zero1": (dict(type="zero1", precision="fp32"), (dict(type="zero1", precision="bf16"), None), 1),
    "zero2": (dict(type="zero2", precision="fp32"), (dict(type="zero2", precision="bf16"), None), 1),
}


class _Failed(str):
    """The traceback of a case that raised on this rank (it fails only its own test)."""


def _compiled_vs_eager(rank: int, world: int, plugin: Any, mixed: Any, backend: str) -> dict[str, Any]:
    _, model, wrapper = boost_net(plugin, mixed, K, compile=False)
    eager = train(model, wrapper, STEPS, rank, world, K)
    torch.compiler.reset()  # a fresh dynamo cache: this case's graphs are compiled by this case's backend
    counting = CountingBackend(backend)
    _, model, wrapper = boost_net(plugin, mixed, K, compile=dict(backend=counting))
    compiled = train(model, wrapper, STEPS, rank, world, K)
    # the modules whose forward was replaced in place by its compiled version ("": the root)
    where = sorted(n for n, m in user_module(model).named_modules() if "forward" in vars(m))
    return dict(eager=eager, compiled=compiled, graphs=counting.graphs, runs=counting.runs, where=where)


def _booster_save_model_round_trip(rank: int, world: int, work: str) -> dict[str, Any]:
    """torch_fsdp compiled per block: save_model, load into an eager model, save it, load back into the compiled."""
    torch.compiler.reset()
    counting = CountingBackend("aot_eager")
    booster, compiled, c_wrapper = boost_net("torch_fsdp", None, K, compile=dict(backend=counting))
    train(compiled, c_wrapper, 3, rank, world, K)
    booster.save_model(compiled, f"{work}/from_compiled", shard=True, use_safetensors=True)
    keys: list[str] = []
    for path in glob.glob(f"{work}/from_compiled/*.safetensors"):
        with safe_open(path, framework="pt") as f:
            keys.extend(f.keys())
    e_booster, eager, e_wrapper = boost_net("torch_fsdp", None, K, compile=False)
    e_booster.load_model(eager, f"{work}/from_compiled")
    loaded_eager = full_weights(eager)
    saved_compiled = full_weights(compiled)
    train(eager, e_wrapper, 1, rank, world, K, first=3)
    e_booster.save_model(eager, f"{work}/from_eager", shard=True, use_safetensors=True)
    booster.load_model(compiled, f"{work}/from_eager")
    loaded_compiled = full_weights(compiled)
    runs = counting.runs
    train(compiled, c_wrapper, 1, rank, world, K, first=4)  # still compiled code after the load
    return dict(
        keys=keys,
        loaded_eager=loaded_eager,
        saved_compiled=saved_compiled,
        eager_after=full_weights(eager),
        loaded_compiled=loaded_compiled,
        runs_after_load=counting.runs - runs,
    )


def _strategy(work: str, name: str) -> Strategy:
    return Strategy(plugin=dict(type="zero2", precision="fp32"), work_dir=os.path.join(work, name),
                    log_kwargs=dict(console=False))  # fmt: skip


def _prepare(strategy: Strategy, compile: Any) -> tuple[Any, Any]:
    return strategy.prepare(  # type: ignore[no-any-return]
        make_net(),
        optim_wrapper=dict(optimizer=dict(type="AdamW", lr=1e-2), accumulative_counts=K),
        compile=compile,
        dispatch_kwargs=dict(max_iters=100),
    )


def _strategy_checkpoint_round_trip(rank: int, world: int, work: str) -> dict[str, Any]:
    """zero2 compiled through Strategy.prepare: save_checkpoint, load into an eager Strategy and back."""
    torch.compiler.reset()
    counting = CountingBackend("aot_eager")
    compiled = _strategy(work, "compiled")
    model, wrapper = _prepare(compiled, dict(backend=counting))
    train(model, wrapper, 3, rank, world, K)
    path = compiled.save_checkpoint("ckpt")
    keys = list(SafeFileSystemReader(path).read_metadata().state_dict_metadata)
    eager = _strategy(work, "eager")
    e_model, e_wrapper = _prepare(eager, False)
    eager.load_checkpoint(path)
    loaded_eager = full_weights(e_model)
    saved_compiled = full_weights(model)
    train(e_model, e_wrapper, 1, rank, world, K, first=3)
    back = eager.save_checkpoint("ckpt_eager")
    compiled.load_checkpoint(back)
    runs = counting.runs
    loaded_compiled = full_weights(model)
    eager_after = full_weights(e_model)
    train(model, wrapper, 1, rank, world, K, first=4)
    return dict(
        keys=keys,
        loaded_eager=loaded_eager,
        saved_compiled=saved_compiled,
        eager_after=eager_after,
        loaded_compiled=loaded_compiled,
        runs_after_load=counting.runs - runs,
    )


def _guarded(part: Any, *args: Any) -> Any:
    try:
        return part(*args)
    except Exception:
        return _Failed(traceback.format_exc())


def _all_cases(rank: int, world: int, work: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (plugin, (mixed_plugin, mixed), _) in PLUGIN_CASES.items():
        out[("fp32", name)] = _guarded(_compiled_vs_eager, rank, world, plugin, None, "inductor")
        out[("mixed", name)] = _guarded(_compiled_vs_eager, rank, world, mixed_plugin, mixed, "aot_eager")
    out["save_model"] = _guarded(_booster_save_model_round_trip, rank, world, os.path.join(work, "booster"))
    out["save_checkpoint"] = _guarded(_strategy_checkpoint_round_trip, rank, world, os.path.join(work, "s"))
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict[str, Any]]:
    work = str(tmp_path_factory.mktemp("compile-distributed"))
    return run_distributed(_all_cases, 2, work, timeout=900)


def _case(ranks: list[dict[str, Any]], key: Any) -> list[Any]:
    results = [r[key] for r in ranks]
    for rank, result in enumerate(results):
        if isinstance(result, _Failed):
            pytest.fail(f"rank {rank} raised:\n{result}")
    return results


@pytest.mark.parametrize("name", list(PLUGIN_CASES))
def test_compiled_fp32_losses_match_eager_within_inductor_rounding(ranks, name):
    for rank, r in enumerate(_case(ranks, ("fp32", name))):
        units = PLUGIN_CASES[name][2]
        assert (r["graphs"], r["runs"]) == (1, STEPS * K * units), f"rank {rank}: compiled code did not run"
        assert r["where"] == (
            ["blocks.0", "blocks.1"] if units == 2 else [""]
        )  # per FSDP2 block, else the root
        diff = max_relative_difference(r["compiled"], r["eager"])
        assert diff <= FP32_TOLERANCE, f"rank {rank}: losses differ by {diff:.3g} relative"


@pytest.mark.parametrize("name", list(PLUGIN_CASES))
def test_compiled_mixed_precision_losses_equal_eager_with_eager_kernels(ranks, name):
    for rank, r in enumerate(_case(ranks, ("mixed", name))):
        units = PLUGIN_CASES[name][2]
        assert (r["graphs"], r["runs"]) == (1, STEPS * K * units), f"rank {rank}: compiled code did not run"
        assert r["where"] == (["blocks.0", "blocks.1"] if units == 2 else [""])
        assert r["compiled"] == r["eager"], f"rank {rank}"


def _assert_round_trip(r: dict[str, Any], units: int) -> None:
    assert r["keys"] and not [k for k in r["keys"] if "_orig_mod" in k]
    assert r["loaded_eager"].keys() == r["saved_compiled"].keys()
    for key, value in r["saved_compiled"].items():
        assert torch.equal(r["loaded_eager"][key], value), key
    assert r["loaded_compiled"].keys() == r["eager_after"].keys()
    for key, value in r["eager_after"].items():
        assert torch.equal(r["loaded_compiled"][key], value), key
    # the eager model trained a step before saving, so loading it back changed the compiled model's weights
    assert any(not torch.equal(r["eager_after"][k], v) for k, v in r["saved_compiled"].items())
    assert r["runs_after_load"] == K * units  # one more window, every forward through the compiled code


def test_booster_save_model_of_a_compiled_fsdp2_model_loads_into_eager_and_back(ranks):
    for r in _case(ranks, "save_model"):
        assert sorted(r["keys"]) == sorted(make_net().state_dict())  # the eager model's names, no prefix
        _assert_round_trip(r, units=2)


def test_strategy_checkpoint_of_a_compiled_zero2_model_loads_into_eager_and_back(ranks):
    for r in _case(ranks, "save_checkpoint"):
        names = list(make_net().state_dict())
        assert all(any(k.endswith(f".{n}") for k in r["keys"]) for n in names), r["keys"]
        _assert_round_trip(r, units=1)
