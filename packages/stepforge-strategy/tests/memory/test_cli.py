# SPDX-License-Identifier: Apache-2.0
"""``stepforge-estimate``: memory sizes and plugin specs as the command spells them, the models it builds, the
table of plugins in 100 columns, Markdown and JSON, the "fits" column (unknown without activations; a GPT shape
traces batch 1 at its context by default) and its exit status, every bad input as one line with exit status 2;
and the committed "What fits" page is exactly what ``--what-fits`` prints."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
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
    with pytest.raises(ValueError, match="no function 'nope'"):
        load_model("stepforge.testing.models:nope")


def test_default_table_reads_in_100_columns_with_activations_of_the_default_batch(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A GPT shape without ``--batch``/``--seq-len``: every default plugin on one row each, no line over 100
    characters, the activations of batch 1 at the shape's context traced (and said so), the "fits" column from
    peaks that include them; exit 0 when one fits, 3 when none does."""
    assert (
        cli.main(["gpt-1.3b", "--world-size", "8", "--device-memory", "16GiB", "--host-memory", "64GiB"]) == 0
    )
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= 100
    assert "activations: batch 1 x 2048 tokens (gpt-1.3b's context; --batch/--seq-len to change)" in lines
    at = next(i for i, line in enumerate(lines) if line.startswith("plugin"))
    assert lines[at].split() == ["plugin", "held", "acts", "peak", "host", "peak", "sent/step", "fits"]
    assert set(lines[at + 1]) == {"-"}
    rows = {
        line.rsplit("  ", 1)[0].split("  ")[0].strip(): line.split()[-1] for line in lines[at + 2 : at + 9]
    }
    assert rows == {"torch_ddp": "NO", "zero1": "yes", "zero2": "yes", "zero2 cpu_offload=True": "yes",
                    "torch_fsdp": "yes", "gemini": "yes", "gemini placement_policy=auto": "yes"}  # fmt: skip
    assert cli.main(["gpt-1.3b", "--plugin", "zero2", "--seq-len", "16", "--batch", "1",
                     "--device-memory", "1GiB"]) == cli.NONE_FITS  # fmt: skip


def test_default_batch_is_batch_1_at_the_context_length(capsys: pytest.CaptureFixture[str]) -> None:
    """No ``--batch``/``--seq-len`` on a GPT shape traces exactly what ``--batch 1 --seq-len 2048`` does."""
    runs = []
    for extra in ([], ["--batch", "1", "--seq-len", "2048"]):
        assert cli.main(["gpt-1.3b", "--plugin", "zero2", "--format", "json", *extra]) == 0
        (run,) = json.loads(capsys.readouterr().out)
        runs.append(run)
    assert runs[0]["activations_traced"] and runs[0]["device"]["activations"] > 0
    assert runs[0]["device"] == runs[1]["device"]


def test_fits_is_unknown_without_activations(capsys: pytest.CaptureFixture[str]) -> None:
    """Another model without an example batch: "fits: unknown (activations not estimated)" where the model
    states fit (exit 0: it may fit), "NO" where they alone do not (exit 3)."""
    args = [
        "stepforge.testing.models:tanh_mlp",
        "--world-size",
        "2",
        "--plugin",
        "zero2",
        "--plugin",
        "torch_ddp",
    ]
    assert cli.main([*args, "--device-memory", "1GiB"]) == 0
    out = capsys.readouterr().out
    assert [line.split()[-1] for line in out.splitlines()[3:5]] == ["unknown", "unknown"]
    assert "fits: unknown (activations not estimated)" in out
    assert cli.main([*args, "--device-memory", "100", "--format", "json"]) == cli.NONE_FITS
    assert [e["fits"] for e in json.loads(capsys.readouterr().out)] == [False, False]
    assert cli.main([*args, "--device-memory", "1GiB", "--format", "json"]) == 0
    assert [e["fits"] for e in json.loads(capsys.readouterr().out)] == ["unknown", "unknown"]


#: one bad input per kind, and the words its one-line error must hold
BAD_INPUTS = [
    (["gpt-9b"], "unknown model 'gpt-9b' (use a GPT shape: gpt-1.3b, gpt-7b, gpt-70b;"),
    (["gpt-7b", "--world-size", "0"], "--world-size must be >= 1, got 0 ("),
    (["gpt-7b", "--precision", "fp64"], "invalid choice: 'fp64' (choose from 'fp32', 'bf16', 'fp16')"),
    (["gpt-7b", "--plugin", "nosuch"], "unknown plugin 'nosuch' (available: "),
    (["mypkg.none:build"], "model factory 'mypkg.none:build': No module named 'mypkg' (install"),
    (["gpt-7b", "--optimizer", "Nope"], "unknown optimizer 'Nope' (available: ASGD, Adadelta,"),
    (
        ["hf:does-not-exist"],
        "hf:does-not-exist is neither a local folder nor in the local Hugging Face cache (",
    ),
    (["gpt-7b", "--plugin", "zero2:stage=7"], "--plugin 'zero2:stage=7': "),
    (["gpt-7b", "--batch", "1"], "--batch and --seq-len go together ("),
    (["gpt-7b", "--world-size", "x"], "invalid int value: 'x' (see stepforge-estimate --help)"),
]


@pytest.mark.parametrize(("argv", "words"), BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS])
def test_bad_input_is_one_line_and_exit_status_2(
    argv: list[str], words: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every user error: one line ``stepforge-estimate: error: <what> (<the fix>)`` on standard error, exit
    status 2, nothing on standard output; an unknown name lists what is available; ``hf:`` never opens a
    connection (the local cache only)."""
    import socket

    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("the command opened a network connection")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    captured = capsys.readouterr()
    assert exit_.value.code == 2 and captured.out == ""
    assert re.fullmatch(r"stepforge-estimate: error: [^\n]+ \([^\n]+\)\n", captured.err), captured.err
    assert words in captured.err


def test_the_console_command_prints_no_traceback() -> None:
    """The installed entry point (``python -m``) ends a bad input with the one line, not a traceback."""
    done = subprocess.run(
        [sys.executable, "-m", "stepforge.strategy.memory.cli", "gpt-9b"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert (
        done.stderr.startswith("stepforge-estimate: error: unknown model 'gpt-9b'")
        and done.stderr.count("\n") == 1
    )


def test_json_and_markdown(capsys: pytest.CaptureFixture[str]) -> None:
    """JSON: one ``Estimate.to_dict()`` per plugin with ``fits``; Markdown: one row per plugin; with a batch the
    activations are traced."""
    assert cli.main(["gpt-1.3b", "--plugin", "zero1", "--format", "json", "--device-memory", "80GiB",
                     "--batch", "1", "--seq-len", "16"]) == 0  # fmt: skip
    data = json.loads(capsys.readouterr().out)
    assert data[0]["plugin"] == "zero1" and data[0]["fits"] is True and data[0]["world_size"] == 8
    assert cli.main(["stepforge.testing.models:tanh_mlp", "--plugin", "single", "--world-size", "1",
                     "--format", "markdown", "--optimizer", "SGD", "--momentum", "0.9"]) == 0  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| plugin |") and lines[2].startswith("| `single`")


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

    args = ["gpt-1.3b", "--plugin", "zero2", "--precision", "bf16", "--world-size", "8", "--format", "json",
            "--batch", "1", "--seq-len", "16"]  # fmt: skip
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
