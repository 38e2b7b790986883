# SPDX-License-Identifier: Apache-2.0
"""Property test: every way of damaging a committed checkpoint -- a flipped byte anywhere, a truncation to any
length, a removed file, for every file of its directory (``COMMIT.json`` included) -- makes ``resume`` raise
``CheckpointError`` (never another exception type, never a silent load) and leaves the live run bit for bit as
it was. Every file is covered by an explicit pass; hypothesis then draws offsets and lengths (bounded examples,
well under a minute)."""

from __future__ import annotations

import os
from typing import Any

import pytest
from _snapshot import differences, snapshot
from _strategy_cases import COUNTS, make_strategy, prepare, train
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepforge.strategy import CheckpointError
from stepforge.strategy.checkpoint._layout import MARKER

_RUN: dict[str, Any] = {}


def _setup(root: str) -> tuple[str, Any]:
    """One committed checkpoint and one live run (mid-window, stepped) per test session."""
    if "path" not in _RUN:
        s = make_strategy(os.path.join(root, "saver"))
        prepare(s)
        train(s, 0, COUNTS, 0)
        _RUN["path"] = s.save_checkpoint(os.path.join(root, "good"))
        victim = make_strategy(os.path.join(root, "victim"))
        prepare(victim, model_seed=5)
        train(victim, 0, COUNTS + 1, 0)
        _RUN["victim"] = victim
    return _RUN["path"], _RUN["victim"]


def _refused_and_untouched(path: str, victim: Any, what: str) -> None:
    # taken here: hypothesis seeds python's and numpy's generators around each example
    before = snapshot(victim)
    try:
        victim.resume(path)
    except CheckpointError:
        pass
    except BaseException as exc:  # any other type is the failure this test looks for
        pytest.fail(f"{what}: {type(exc).__name__} instead of CheckpointError: {exc}")
    else:
        pytest.fail(f"{what}: the damaged checkpoint loaded")
    diff = differences(before, snapshot(victim))
    assert not diff, (what, diff)


class _Damaged:
    """Damage one file of ``path`` and restore its exact bytes afterwards."""

    def __init__(self, path: str, name: str) -> None:
        self.file = os.path.join(path, name)
        with open(self.file, "rb") as f:
            self.data = f.read()

    def flip(self, offset: int, mask: int) -> None:
        data = bytearray(self.data)
        data[offset] ^= mask
        self._write(bytes(data))

    def truncate(self, size: int) -> None:
        self._write(self.data[:size])

    def remove(self) -> None:
        os.remove(self.file)

    def _write(self, data: bytes) -> None:
        with open(self.file, "wb") as f:
            f.write(data)

    def __enter__(self) -> _Damaged:
        return self

    def __exit__(self, *exc: object) -> None:
        self._write(self.data)


def _names(path: str) -> list[str]:
    names = sorted(os.listdir(path))
    assert MARKER in names and ".metadata" in names and any(n.endswith(".distcp") for n in names)
    return names


def test_every_file_removed_truncated_or_flipped_is_refused(tmp_path_factory):
    path, victim = _setup(str(tmp_path_factory.mktemp("fuzz")))
    for name in _names(path):
        size = os.path.getsize(os.path.join(path, name))
        with _Damaged(path, name) as d:
            d.remove()
            _refused_and_untouched(path, victim, f"{name} removed")
        for keep in sorted({0, 1, size // 2, size - 1}):
            with _Damaged(path, name) as d:
                d.truncate(keep)
                _refused_and_untouched(path, victim, f"{name} truncated to {keep}")
        for offset in sorted({0, size // 2, size - 1}):
            with _Damaged(path, name) as d:
                d.flip(offset, 0x80)
                _refused_and_untouched(path, victim, f"{name} byte {offset} flipped")
    victim.resume(path)  # every byte restored: it loads
    _RUN.clear()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_damage_is_refused(tmp_path_factory, data):
    path, victim = _setup(str(tmp_path_factory.mktemp("fuzz")))
    name = data.draw(st.sampled_from(_names(path)), label="file")
    size = os.path.getsize(os.path.join(path, name))
    kind = data.draw(st.sampled_from(["flip", "truncate", "remove"]), label="damage")
    with _Damaged(path, name) as d:
        if kind == "flip":
            offset = data.draw(st.integers(0, size - 1), label="offset")
            mask = data.draw(st.integers(1, 255), label="mask")
            d.flip(offset, mask)
            what = f"{name} byte {offset} ^ {mask:#x}"
        elif kind == "truncate":
            keep = data.draw(st.integers(0, size - 1), label="keep")
            d.truncate(keep)
            what = f"{name} truncated to {keep}"
        else:
            d.remove()
            what = f"{name} removed"
        _refused_and_untouched(path, victim, what)
