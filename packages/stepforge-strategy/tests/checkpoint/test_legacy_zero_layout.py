# SPDX-License-Identifier: Apache-2.0
"""ZeRO optimizer saves in the index-keyed layout of earlier versions still load (fixture of main 817af2f).

``fixtures/booster_zero2_fp32_index_optimizer``: zero2, fp32, Adam, two steps at world size 2, written by
``fixtures/make_zero_index_fixture.py`` with that commit's packages: state keyed ``"<index>"``, 1-D tensors of the
flattened parameters. Loaded at world size 3 (other pieces than saved), the optimizer must hold exactly what the
checkpoint holds, read back offline with torch's own ``dcp_to_torch_save``; another plugin refuses it, naming it.
"""

from __future__ import annotations

import pathlib

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from stepforge.testing.distributed import requires_gloo, run_distributed

pytestmark = [pytest.mark.distributed, requires_gloo]

FIXTURE = pathlib.Path(__file__).parents[1] / "fixtures" / "booster_zero2_fp32_index_optimizer"


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))


def _load(rank: int, world_size: int, directory: str) -> dict:
    from stepforge.strategy import Booster
    from stepforge.strategy.checkpoint import CheckpointMismatchError

    booster = Booster(plugin=dict(type="zero2", precision="fp32"))
    model = _model()
    model, opt, *_ = booster.boost(model, torch.optim.Adam(model.parameters(), lr=0.1))
    booster.load_optimizer(opt, directory)
    out = {"state": opt.state_dict()}  # ZeRO's gathered form: by index, in the parameters' shapes
    booster = Booster(plugin="torch_ddp")
    model = _model()
    model, other, *_ = booster.boost(model, torch.optim.Adam(model.parameters(), lr=0.1))
    try:
        booster.load_optimizer(other, directory)
    except CheckpointMismatchError as exc:
        out["refusal"] = str(exc)
    return out


def test_an_index_keyed_zero_save_loads_at_another_world_size(tmp_path):
    offline = tmp_path / "offline.pt"
    dcp_to_torch_save(str(FIXTURE), str(offline))
    saved = torch.load(offline, weights_only=False)["optimizer"]  # our own fixture, read by torch's tool
    shapes = [p.shape for p in _model().parameters()]
    results = run_distributed(_load, 3, str(FIXTURE), timeout=180)
    for rank, got in enumerate(results):
        state = got["state"]["state"]
        assert sorted(state) == list(range(len(shapes)))
        for index, shape in enumerate(shapes):
            entry = saved["state"][str(index)]
            assert state[index].keys() == entry.keys()
            assert torch.equal(state[index]["step"], entry["step"]) and entry["step"].item() == 2
            for key in ("exp_avg", "exp_avg_sq"):
                want = entry[key].reshape(shape)
                assert want.abs().sum() > 0 and torch.equal(state[index][key], want), (rank, index, key)
        assert "earlier version" in got["refusal"] and "zero1/zero2" in got["refusal"], got["refusal"]
