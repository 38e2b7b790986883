# SPDX-License-Identifier: Apache-2.0
"""The message hub's state survives torch.save / torch.load(weights_only=True) through the plain form."""

from __future__ import annotations

import io
import pickle

import numpy as np
import pytest
import torch
from mmengine.logging import HistoryBuffer, MessageHub

from stepforge.mmengine import message_hub_from_plain, message_hub_to_plain


def _hub() -> MessageHub:
    hub = MessageHub.get_instance("stepforge-test-hub")
    for i in range(5):
        hub.update_scalar("train/loss", 1.0 / (i + 1))
        hub.update_scalar("train/lr", 0.1 * i, count=2)
    hub.update_info("iter", 5)
    hub.update_info("last_ckpt", "/tmp/x/iter_5.pth")
    hub.update_info("keep_ckpt_ids", [1, 2])
    hub.update_info("mask", np.arange(3, dtype=np.int32))
    hub.update_info("np_scalar", np.float32(0.5))
    return hub


def test_raw_message_hub_state_is_refused_by_weights_only_load():
    # why the conversion exists: torch's default load rejects the HistoryBuffer mmengine saves
    buf = io.BytesIO()
    torch.save(_hub().state_dict(), buf)
    buf.seek(0)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(buf, weights_only=True)


def test_plain_state_round_trips_under_weights_only():
    hub = _hub()
    buf = io.BytesIO()
    torch.save(message_hub_to_plain(hub.state_dict()), buf)
    buf.seek(0)
    restored = message_hub_from_plain(torch.load(buf, weights_only=True))
    fresh = MessageHub.get_instance("stepforge-test-hub-restored")
    fresh.load_state_dict(restored)
    for key in ("train/loss", "train/lr"):
        got, want = fresh.get_scalar(key), hub.get_scalar(key)
        assert isinstance(got, HistoryBuffer)
        np.testing.assert_array_equal(got.data[0], want.data[0])
        np.testing.assert_array_equal(got.data[1], want.data[1])
        assert got.max_length == want.max_length
    assert fresh.get_scalar("train/loss").mean() == pytest.approx(np.mean([1.0, 1 / 2, 1 / 3, 1 / 4, 1 / 5]))
    assert fresh.get_info("iter") == 5
    assert fresh.get_info("last_ckpt") == "/tmp/x/iter_5.pth"
    assert fresh.get_info("keep_ckpt_ids") == [1, 2]
    mask = fresh.get_info("mask")
    assert isinstance(mask, np.ndarray) and mask.dtype == np.int32
    np.testing.assert_array_equal(mask, np.arange(3))
    assert fresh.get_info("np_scalar") == 0.5


def test_non_plain_runtime_info_is_dropped_with_a_warning():
    state = {"log_scalars": {}, "runtime_info": {"ok": 1, "obj": object()}, "resumed_keys": {}}
    with pytest.warns(UserWarning, match="'obj'"):
        plain = message_hub_to_plain(state)
    assert plain["runtime_info"] == {"ok": 1}


def test_bad_input_is_refused_with_a_clear_error():
    with pytest.raises(TypeError, match="MessageHub.state_dict"):
        message_hub_to_plain({"log_scalars": {}})


def test_non_plain_states_pass_through_unchanged():
    state = {"log_scalars": {}, "runtime_info": {}}
    assert message_hub_from_plain(state) is state


class _DeviceResident(torch.Tensor):
    """Behaves like a CUDA tensor for ``numpy()`` (refused) and ``cpu()`` (a plain CPU copy)."""

    def numpy(self, *args, **kwargs):
        raise TypeError(
            "can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy it first."
        )

    def cpu(self, *args, **kwargs):
        return self.as_subclass(torch.Tensor).clone()


def test_plain_state_read_onto_a_device_restores():
    # resume reads the checkpoint's objects with map_location = the plugin's device: on a GPU the histories
    # and arrays arrive as CUDA tensors, which numpy() refuses
    hub = _hub()
    plain = message_hub_to_plain(hub.state_dict())
    for entry in plain["log_scalars"].values():
        for key in ("log_history", "count_history"):
            entry[key] = entry[key].as_subclass(_DeviceResident)
    plain["runtime_info"]["mask"] = plain["runtime_info"]["mask"].as_subclass(_DeviceResident)
    restored = message_hub_from_plain(plain)
    np.testing.assert_array_equal(
        restored["log_scalars"]["train/loss"].data[0], hub.get_scalar("train/loss").data[0]
    )
    np.testing.assert_array_equal(restored["runtime_info"]["mask"], np.arange(3))
