# SPDX-License-Identifier: Apache-2.0
"""The one writer (``checkpoint/_writer.py``): a failed save (a full disk) removes its temporary files, raises
CheckpointError chained to the OSError and leaves every committed checkpoint as it was; rotation only follows a
commit; a re-save killed at any point between its renames leaves a committed copy that
``find_latest_checkpoint`` finds and the next save and resume use."""

from __future__ import annotations

import errno
import os

import pytest
from _strategy_cases import full_params, make_strategy, prepare, train

from stepforge.strategy.checkpoint import (
    CheckpointError,
    _dcp,
    _layout,
    _writer,
    find_latest_checkpoint,
)
from stepforge.strategy.checkpoint._layout import LAST_CHECKPOINT, MARKER, read_commit


class _Killed(BaseException):
    """A kill: no ``except Exception`` handler runs (nothing is cleaned up or rolled back)."""


def _enospc(*_: object) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def _snapshot(folder: str) -> dict[str, bytes]:
    out = {}
    for root, _, names in os.walk(folder):
        for name in names:
            full = os.path.join(root, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, folder)] = f.read()
    return out


def _leftovers(folder: str) -> list[str]:
    return sorted(e for e in os.listdir(folder) if ".tmp-" in e or ".old-" in e)


def _trained(work: str, iters: int = 3):
    s = make_strategy(work)
    prepare(s)
    train(s, 0, iters, 0)
    return s


@pytest.mark.parametrize("when", ["data", "marker"])
@pytest.mark.parametrize("same_name", [False, True])
def test_a_full_disk_removes_the_temporary_directory_and_keeps_the_committed_one(
    tmp_path, monkeypatch, when, same_name
):
    work = str(tmp_path)
    s = _trained(work)
    kept = s.save_checkpoint("iter_3", max_keep_ckpts=1)
    before = _snapshot(work)
    train(s, 3, 6, 0)
    if when == "data":  # the DCP data file of this rank was just written: the disk fills up after it
        monkeypatch.setattr(_dcp, "_AFTER_WRITE_HOOK", _enospc)
    else:  # every data file is written, the commit marker is not
        monkeypatch.setattr(_writer, "write_text_atomic", _enospc)
    with pytest.raises(CheckpointError, match="No space left") as info:
        s.save_checkpoint("iter_3" if same_name else "iter_6", max_keep_ckpts=1)
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.ENOSPC
    assert _leftovers(work) == []  # the temporary directory and its shards are gone
    assert _snapshot(work) == before  # iter_3, last_checkpoint: byte for byte (no rotation either)
    assert find_latest_checkpoint(work) == kept and read_commit(kept)["meta"]["iter"] == 3
    monkeypatch.undo()
    # the next save works and rotates only now that it is committed
    new = s.save_checkpoint("iter_6", max_keep_ckpts=1)
    assert find_latest_checkpoint(work) == new and not os.path.exists(kept)


# an os.replace that fails (an OSError, not a kill) at the marker (0), moving the older copy aside (1) or moving
# the new one in (2): the older copy is back in place byte for byte and nothing temporary is left
@pytest.mark.parametrize("fail_at", [0, 1, 2])
def test_a_failed_rename_puts_the_older_copy_back(tmp_path, monkeypatch, fail_at):
    work = str(tmp_path)
    s = _trained(work)
    kept = s.save_checkpoint("iter_3")
    before = _snapshot(work)
    train(s, 3, 6, 0)
    real, count = os.replace, [0]

    def replace(src, dst):
        if count[0] == fail_at:
            count[0] += 1
            _enospc()
        count[0] += 1
        real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(CheckpointError, match="No space left") as info:
        s.save_checkpoint("iter_3")
    monkeypatch.undo()
    assert isinstance(info.value.__cause__, OSError)
    assert _snapshot(work) == before and _leftovers(work) == []
    assert find_latest_checkpoint(work) == kept and read_commit(kept)["meta"]["iter"] == 3


def _replace_calls(work: str) -> list[tuple[str, str]]:
    """The os.replace calls of a re-save of ``iter_3``, in order (recorded from a real one)."""
    s = _trained(work)
    s.save_checkpoint("iter_3")
    calls: list[tuple[str, str]] = []
    real = os.replace

    def record(src, dst):
        calls.append((os.path.basename(src), os.path.basename(dst)))
        real(src, dst)

    os.replace = record
    try:
        s.save_checkpoint("iter_3")
    finally:
        os.replace = real
    return calls


def test_the_recorded_rename_order_of_a_re_save(tmp_path):
    calls = _replace_calls(str(tmp_path))
    kinds = [
        "marker" if dst == MARKER else "pointer" if dst == LAST_CHECKPOINT else
        "aside" if ".old-" in dst else "in" if dst == "iter_3" else dst
        for _, dst in calls
    ]  # fmt: skip
    assert kinds == ["marker", "aside", "in", "pointer"]


# kill before the nth os.replace of the re-save (0: marker, 1: old aside, 2: new in, 3: last_checkpoint), or
# after all of them (while the older copy is deleted)
@pytest.mark.parametrize("kill_at", [0, 1, 2, 3, "rmtree"])
def test_a_re_save_killed_between_the_renames_leaves_a_committed_copy(tmp_path, monkeypatch, kill_at):
    work = str(tmp_path)
    s = _trained(work)
    s.save_checkpoint("iter_3")
    train(s, 3, 6, 0)
    expected = full_params(s.model)
    real, count = os.replace, [0]

    def replace(src, dst):
        if count[0] == kill_at:
            raise _Killed
        count[0] += 1
        real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    if kill_at == "rmtree":
        monkeypatch.setattr(_writer.shutil, "rmtree", lambda *a, **k: (_ for _ in ()).throw(_Killed()))
    with pytest.raises(_Killed):
        s.save_checkpoint("iter_3")
    monkeypatch.undo()
    found = find_latest_checkpoint(work)
    assert found is not None
    record = _layout.verify_dir(found)  # committed, and every file intact
    assert record["meta"]["iter"] in (3, 6)
    if kill_at in (2, 3, "rmtree"):  # the new copy is committed (in its temporary or its final place)
        assert record["meta"]["iter"] == 6
    # a resume from what was found works, in a new strategy
    other = make_strategy(work)
    prepare(other, model_seed=5)
    other.resume(found)
    if record["meta"]["iter"] == 6:
        got = full_params(other.model)
        assert got.keys() == expected.keys() and all((got[k] == expected[k]).all() for k in got)
    # the next save of that name recovers and leaves nothing behind
    final = s.save_checkpoint("iter_3")
    assert find_latest_checkpoint(work) == final and read_commit(final)["meta"]["iter"] == 6
    assert _leftovers(work) == []


def test_the_next_save_of_a_name_brings_back_its_orphaned_copy_before_anything_else(tmp_path, monkeypatch):
    """Killed after the older copy moved aside: a save of ANOTHER name keeps the orphaned copy, and it still
    counts for rotation after that save's commit (max_keep_ckpts=2 keeps both)."""
    work = str(tmp_path)
    s = _trained(work)
    s.save_checkpoint("iter_3")
    real, count = os.replace, [0]

    def replace(src, dst):
        if count[0] == 2:
            raise _Killed
        count[0] += 1
        real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(_Killed):
        s.save_checkpoint("iter_3")
    monkeypatch.undo()
    assert not os.path.exists(os.path.join(work, "iter_3"))
    assert os.path.basename(find_latest_checkpoint(work)).startswith(".iter_3.")
    s.save_checkpoint("iter_3")  # recovery: the orphaned copy is renamed back, then replaced by the new save
    assert sorted(os.listdir(work)) == sorted(["iter_3", LAST_CHECKPOINT, *_logs(work)])


def _logs(work: str) -> list[str]:
    return [e for e in os.listdir(work) if e not in ("iter_3", LAST_CHECKPOINT) and not e.startswith(".")]
