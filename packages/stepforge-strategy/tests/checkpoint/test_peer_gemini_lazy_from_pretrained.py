# SPDX-License-Identifier: Apache-2.0
"""Peer check: ColossalAI's ``exam_lazy_from_pretrained`` (``tests/test_checkpoint_io/test_gemini_checkpoint_io.py``)
on 4 gloo ranks, its body unchanged, only the imports pointed at stepforge.

``LazyInitContext`` + ``LlamaForCausalLM.from_pretrained`` + ``GeminiPlugin`` boost + ``save_model``; the saved
model equals the pretrained weights. ``LLAMA_PATH`` is a small Llama saved from a config here (no download);
``shared_tempdir`` and ``check_state_dict_equal`` are ColossalAI's test utilities rewritten below (the latter
compares bitwise after the dtype cast, where ColossalAI allows 1e-3).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist

from stepforge.testing.distributed import requires_gloo, run_distributed


@contextmanager
def shared_tempdir() -> Iterator[str]:
    """ColossalAI's ``tests/test_checkpoint_io/utils.shared_tempdir``: rank 0 makes a directory, every rank
    gets its name, rank 0 removes it."""
    name = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(name, src=0)
    try:
        yield str(name[0])
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(str(name[0]), ignore_errors=True)


def check_state_dict_equal(
    d1: dict, d2: dict, ignore_device: bool = True, ignore_dtype: bool = False
) -> None:
    """ColossalAI's ``colossalai.testing.check_state_dict_equal`` for flat tensor dicts, bitwise."""
    assert sorted(d1) == sorted(d2)
    for k, v1 in d1.items():
        v2 = d2[k]
        if ignore_dtype:
            v1 = v1.to(v2.dtype)
        if ignore_device:
            v1 = v1.to(v2.device)
        assert torch.equal(v1, v2), k


# -- ColossalAI's test, only the imports changed ------------------------------------------------------------
def exam_lazy_from_pretrained():
    from transformers import LlamaForCausalLM

    from stepforge.strategy import Booster, GeminiPlugin, LazyInitContext

    llama_path = os.environ["LLAMA_PATH"]
    plugin = GeminiPlugin()
    booster = Booster(plugin=plugin)
    orig_model = LlamaForCausalLM.from_pretrained(llama_path)
    orig_state_dict = {k: v.half() for k, v in orig_model.state_dict().items()}
    with LazyInitContext():
        model = LlamaForCausalLM.from_pretrained(llama_path)
    model, *_ = booster.boost(model)
    with shared_tempdir() as tempdir:
        save_path = os.path.join(tempdir, "model.pt")
        booster.save_model(model, save_path, shard=False)
        dist.barrier()
        state_dict = torch.load(save_path, map_location="cpu")
        check_state_dict_equal(state_dict, orig_state_dict, ignore_dtype=True)


def _run(rank: int, world: int, llama_path: str) -> bool:
    import warnings

    os.environ["LLAMA_PATH"] = llama_path
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # gemini's default fp16 on a CPU: the slow-configuration warning
        exam_lazy_from_pretrained()
    return True


@pytest.mark.distributed
@requires_gloo
def test_colossalai_exam_lazy_from_pretrained_on_four_ranks(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(str(tmp_path / "llama"))
    assert run_distributed(_run, 4, str(tmp_path / "llama"), timeout=240) == [True] * 4
