# SPDX-License-Identifier: Apache-2.0
"""``stepforge-estimate``: memory sizes and plugin specs as the command spells them, the models it builds, the
side-by-side table, Markdown and JSON, the "fits" row and its exit status; and the committed "What fits" page
is exactly what ``--what-fits`` prints."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from stepforge.strategy.memory import cli
from stepforge.strategy.memory._specs import load_model, parse_plugin, parse_size
from stepforge.strategy.memory.gpt import GPT_SHAPES

ROOT = Path(os.environ.get("STEPFORGE_SOURCE_ROOT", Path(__file__).resolve().parents[4]))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("80GiB", 80 * 1024**3),
        ("80G", 80 * 1024**3),
        ("80GB", 80 * 10**9),
        ("1.5TiB", int(1.5 * 1024**4)),
        ("512", 512),
    ],
)
def test_sizes(text: str, expected: int) -> None:
    """Binary units (``GiB``, a bare ``G``), decimal ones (``GB``) and plain bytes."""
    assert parse_size(text) == expected


def test_bad_size_shows_the_forms() -> None:
    with pytest.raises(ValueError, match="80GiB"):
        parse_size("lots")


def test_plugin_specs() -> None:
    """``name:key=literal,...``; a setting that is not ``key=literal`` is refused."""
    assert parse_plugin("zero2") == ("zero2", {})
    assert parse_plugin("gemini:placement_policy='auto', extra_dp_size=2") == (
        "gemini",
        {"placement_policy": "auto", "extra_dp_size": 2},
    )
    with pytest.raises(ValueError, match="key=value"):
        parse_plugin("zero2:cpu_offload")
    with pytest.raises(ValueError, match="literal"):
        parse_plugin("zero2:cpu_offload=yes please")


def test_models_by_name_and_factory() -> None:
    """A GPT shape name builds that GPT on the meta device; ``package.module:function`` calls the factory there."""
    model = load_model("gpt-1.3b")
    assert sum(p.numel() for p in model.parameters()) == GPT_SHAPES["gpt-1.3b"].parameters
    assert all(p.is_meta for p in model.parameters())
    built = load_model("stepforge.testing.models:tanh_mlp")
    assert all(p.is_meta for p in built.parameters())
    with pytest.raises(ValueError, match="gpt-7b"):
        load_model("nonsense")


def test_table_with_fits_row_and_exit_status(capsys: pytest.CaptureFixture[str]) -> None:
    """The table has one column per plugin and a "fits" row; exit 0 when one fits, 3 when none does."""
    args = ["gpt-1.3b", "--world-size", "8", "--plugin", "torch_ddp", "--plugin", "zero2:cpu_offload=True"]
    assert cli.main([*args, "--device-memory", "16GiB", "--host-memory", "64GiB"]) == 0
    out = capsys.readouterr().out
    assert "torch_ddp" in out and "zero2 cpu_offload=True" in out
    fits_row = next(line for line in out.splitlines() if line.startswith("fits"))
    assert fits_row.split("|")[1:] and [c.strip() for c in fits_row.split("|")[1:]] == ["NO", "yes"]
    assert cli.main([*args, "--device-memory", "1GiB"]) == cli.NONE_FITS


def test_json_and_markdown(capsys: pytest.CaptureFixture[str]) -> None:
    """JSON: one ``Estimate.to_dict()`` per plugin with ``fits``; Markdown: one row per plugin; with a batch the
    activations are traced."""
    assert cli.main(["gpt-1.3b", "--plugin", "zero1", "--format", "json", "--device-memory", "80GiB"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data[0]["plugin"] == "zero1" and data[0]["fits"] is True and data[0]["world_size"] == 8
    assert cli.main(["stepforge.testing.models:tanh_mlp", "--plugin", "single", "--world-size", "1",
                     "--format", "markdown", "--optimizer", "SGD", "--momentum", "0.9"]) == 0  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| plugin |") and lines[2].startswith("| `single`")
    with pytest.raises(SystemExit):
        cli.main(["gpt-1.3b", "--batch", "1"])  # --seq-len missing


def test_committed_what_fits_page_is_the_commands_output() -> None:
    """docs/what-fits.md is what ``stepforge-estimate --what-fits --accuracy <the committed result>`` prints."""
    page = (ROOT / "docs" / "what-fits.md").read_text()
    marker = page.split("--accuracy ", 1)[1].split("`", 1)[0]
    from stepforge.strategy.memory._what_fits import what_fits_page

    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        expected = what_fits_page(accuracy=None if marker == "<none>" else marker.split())
    finally:
        os.chdir(cwd)
    assert page == expected, "regenerate with: nox -s what_fits"


def test_accumulation_steps(capsys: pytest.CaptureFixture[str]) -> None:
    """``--accumulation-steps 4`` with ZeRO-2 in bf16: the estimate describes a window of four micro-batches, in
    which every rank also holds the whole model's local bf16 gradients (kept under ``no_sync``) between
    micro-batches; 0 is refused."""
    from stepforge.strategy.memory.gpt import gpt

    args = ["gpt-1.3b", "--plugin", "zero2", "--precision", "bf16", "--world-size", "8", "--format", "json"]
    runs = {}
    for steps in (1, 4):
        assert cli.main([*args, "--accumulation-steps", str(steps)]) == 0
        (runs[steps],) = json.loads(capsys.readouterr().out)
        assert runs[steps]["accumulation_steps"] == steps
    numel = sum(p.numel() for p in gpt("gpt-1.3b").parameters())
    assert runs[4]["window"]["device"] - runs[1]["window"]["device"] == 2 * numel
    assert runs[4]["device"]["peak"] >= runs[1]["device"]["peak"]
    with pytest.raises(SystemExit):
        cli.main([*args, "--accumulation-steps", "0"])
    assert "--accumulation-steps must be >= 1" in capsys.readouterr().err


def test_activation_checkpointing(capsys: pytest.CaptureFixture[str]) -> None:
    """``--activation-checkpointing``: the GPT's blocks are traced recomputed in backward, so the forward keeps a
    block's input per block instead of its activations (the 24 blocks of ``gpt-1.3b`` keep at the loss what the
    head and the blocks' inputs take: under an eighth of the plain trace); the JSON and the table say how it was
    traced."""
    args = ["gpt-1.3b", "--plugin", "torch_fsdp", "--world-size", "8", "--batch", "1", "--seq-len", "64"]
    runs = {}
    for flag in ([], ["--activation-checkpointing"]):
        assert cli.main([*args, *flag, "--format", "json"]) == 0
        (runs[bool(flag)],) = json.loads(capsys.readouterr().out)
    assert runs[True]["activation_checkpointing"] and not runs[False]["activation_checkpointing"]
    assert runs[True]["activations_method"] == runs[False]["activations_method"] == "fake"
    assert 0 < runs[True]["device"]["activations"] < runs[False]["device"]["activations"] / 8
    assert cli.main([*args, "--activation-checkpointing"]) == 0
    assert "activations traced on fake tensors, blocks recomputed in backward" in capsys.readouterr().out
