# SPDX-License-Identifier: Apache-2.0
"""GeminiPlugin's placement arguments on FSDP2: each one changes where parameters live, and training
stays equal to plain torch on one process over the concatenated batch.

One spawn of 4 gloo ranks runs every case (CI budget), bounded by its timeout. The model has four units of
equal bytes in parameter order (``blocks.0``, ``blocks.1``, ``blocks.2`` and the root holding ``head``), so the
fractions select whole units: 0.5 of the bytes = the first two units. Reference: torch on one process, each
step on the 4 ranks' rows (mean loss), 3 SGD(momentum) steps. Tolerance: fp32 where only the reduction order
differs: rtol 1e-4, atol 1e-5.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stepforge.strategy import Booster
from stepforge.testing.distributed import requires_gloo, run_distributed

STEPS, ROWS, WORLD, WIDTH = 3, 2, 4, 8
UNITS = ("blocks.0", "blocks.1", "blocks.2", "")


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Linear(WIDTH, WIDTH) for _ in range(3)])
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(WORLD * ROWS, WIDTH, generator=g), torch.randn(WORLD * ROWS, WIDTH, generator=g)


def _optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _layout(model: nn.Module) -> dict[str, tuple]:
    """Per parameter: (mesh shape, local rows, full rows, device type of the local shard)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), name
        out[name] = (tuple(p.device_mesh.shape), p.to_local().shape[0], p.shape[0], p.to_local().device.type)
    return out


def _train(rank: int, plugin: dict, max_norm: float = 0.0) -> dict:
    booster = Booster(plugin=plugin)
    model = _Net()
    model, opt, *_ = booster.boost(model, _optimizer(model.parameters()))
    layout = _layout(model.unwrap())  # the user's parameter names (the boosted ModelWrapper prefixes module.)
    for step in range(STEPS):
        x, y = _batch(step)
        rows = slice(rank * ROWS, (rank + 1) * ROWS)
        opt.zero_grad()
        booster.backward(F.mse_loss(model(x[rows]), y[rows]), opt)
        if max_norm:
            booster.clip_grad_norm_(opt, max_norm)
        opt.step()
    placement = {k: (v.sharded, v.offload) for k, v in booster.plugin.placement.items()}
    return dict(
        device=booster.plugin.device.type,
        layout=layout,
        placement=placement,
        everywhere=model.state_dict(only_rank_0=False),
        rank0=model.state_dict(only_rank_0=True),
        optim_rank0=opt.state_dict(only_rank_0=True),
        optim_full=booster.plugin.full_optim_state_dict(model, opt, rank0_only=False),
    )


def _full_optimizer_roundtrip(rank: int, path: str) -> dict:
    """torch_fsdp: FSDP1's unsharded optimizer file (full_optim_state_dict) saved, then loaded into a fresh
    boosted Adam; its full state read back."""
    states = []
    for load in (False, True):
        booster = Booster(plugin=dict(type="torch_fsdp", precision="fp32"))
        model = _Net()
        model, opt, *_ = booster.boost(model, torch.optim.Adam(model.parameters(), lr=0.01))
        if load:
            booster.plugin.load_full_optimizer(model, opt, path)
        else:
            x, y = _batch(0)
            booster.backward(
                F.mse_loss(model(x[rank * ROWS : (rank + 1) * ROWS]), y[rank * ROWS :][:ROWS]), opt
            )
            opt.step()
            booster.plugin.save_full_optimizer(model, opt, path)
        states.append(opt.full_optim_state_dict(rank0_only=False))
    file = torch.load(path, weights_only=True) if rank == 0 else None
    return dict(saved=states[0], loaded=states[1], file=file)


def _extra_dp_error() -> str:
    booster = Booster(plugin=dict(type="gemini", precision="fp32", extra_dp_size=3))
    try:
        booster.boost(_Net())
    except ValueError as exc:
        return str(exc)
    return "no error"


def _cases(rank: int, world: int, path: str) -> dict:
    base = dict(type="gemini", precision="fp32")
    return {
        "extra_dp_error": _extra_dp_error(),
        "full_optimizer": _full_optimizer_roundtrip(rank, path),
        "half": _train(rank, dict(base, shard_param_frac=0.5, offload_optim_frac=0.25)),
        "replicated": _train(rank, dict(base, shard_param_frac=0.0)),
        "param_offload": _train(rank, dict(base, offload_param_frac=0.5)),
        "hsdp": _train(rank, dict(base, extra_dp_size=2)),
        "auto": _train(rank, dict(base, placement_policy="auto", shard_param_frac=0.0)),
        "clip": _train(rank, dict(base, shard_param_frac=0.5, extra_dp_size=2), max_norm=0.05),
    }


def _reference(max_norm: float = 0.0) -> tuple[nn.Module, torch.optim.Optimizer]:
    ref = _Net()
    opt = _optimizer(ref.parameters())
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        if max_norm:
            nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        opt.step()
    return ref, opt


def _params_of(unit: str) -> list[str]:
    return [f"{unit}.weight", f"{unit}.bias"] if unit else ["head.weight", "head.bias"]


@requires_gloo
def test_gemini_placement_arguments_place_units_and_train_like_torch(tmp_path):
    out = run_distributed(_cases, WORLD, str(tmp_path / "optimizer.pt"), timeout=300)
    expected = {  # unit -> (sharded, offloaded)
        "half": {"blocks.0": (True, True), "blocks.1": (True, False), "blocks.2": (False, False), "": (False, False)},
        "replicated": dict.fromkeys(UNITS, (False, False)),
        "param_offload": {"blocks.0": (True, True), "blocks.1": (True, True), "blocks.2": (True, False),
                          "": (True, False)},
        "hsdp": dict.fromkeys(UNITS, (True, False)),
        "auto": dict.fromkeys(UNITS, (True, True)),  # auto shards and offloads all; fractions not read
        "clip": {"blocks.0": (True, False), "blocks.1": (True, False), "blocks.2": (False, False), "": (False, False)},
    }  # fmt: skip
    shard_mesh = {"hsdp": (2, 2), "clip": (2, 2)}
    ref, ref_opt = _reference()
    clipped, _ = _reference(max_norm=0.05)
    for case, units in expected.items():
        rank0 = out[0][case]
        assert rank0["placement"] == units, case
        for unit, (sharded, offloaded) in units.items():
            for name in _params_of(unit):
                mesh, local, full, device = rank0["layout"][name]
                # where the shard lives: host memory when offloaded (only tells apart with an accelerator)
                assert device == ("cpu" if offloaded else rank0["device"]), (case, name)
                if sharded:  # rows split over the shard dimension
                    want_mesh = shard_mesh.get(case, (WORLD,))
                    assert (mesh, local) == (want_mesh, full // want_mesh[-1]), (case, name)
                else:  # whole on every rank
                    assert (mesh, local) == ((WORLD, 1), full), (case, name)
        want = clipped if case == "clip" else ref
        for key, value in want.state_dict().items():
            for r in range(WORLD):
                torch.testing.assert_close(out[r][case]["everywhere"][key], value, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(out[0][case]["rank0"][key], value, rtol=1e-4, atol=1e-5)
        assert all(out[r][case]["rank0"] == {} for r in range(1, WORLD)), case
    # clipping took effect: the clipped run differs from the unclipped one
    assert not torch.allclose(clipped.head.weight, ref.head.weight, atol=1e-3)
    # the full optimizer state (FSDP1's full_optim_state_dict), keyed by FQN at full shapes
    names = [n for n, _ in ref.named_parameters()]
    ref_state = ref_opt.state_dict()["state"]
    for case in ("half", "hsdp"):
        for r in range(WORLD):
            assert out[r][case]["optim_rank0"] == {} if r else out[r][case]["optim_rank0"]["state"], (case, r)
            for i, name in enumerate(names):
                want = ref_state[i]["momentum_buffer"]
                torch.testing.assert_close(out[r][case]["optim_full"]["state"][name]["momentum_buffer"], want,
                                           rtol=1e-4, atol=1e-5)  # fmt: skip
        got = out[0][case]["optim_rank0"]["state"]["blocks.0.weight"]["momentum_buffer"]
        torch.testing.assert_close(got, ref_state[0]["momentum_buffer"], rtol=1e-4, atol=1e-5)
    assert "extra_dp_size=3 does not divide the world size 4" in out[0]["extra_dp_error"]
    # FSDP1-style unsharded optimizer file: full shapes keyed by FQN, loaded back at this world size
    roundtrip = [out[r]["full_optimizer"] for r in range(WORLD)]
    file = roundtrip[0]["file"]
    assert file["state"]["blocks.0.weight"]["exp_avg"].shape == (WIDTH, WIDTH)
    assert file["state"]["head.bias"]["exp_avg_sq"].shape == (WIDTH,)
    assert file["param_groups"][0]["params"][0] == "blocks.0.weight"
    assert torch.count_nonzero(file["state"]["blocks.0.weight"]["exp_avg"]) > 0  # a step was taken
    for r in range(WORLD):
        for name, entry in roundtrip[r]["saved"]["state"].items():
            for key, value in entry.items():
                torch.testing.assert_close(roundtrip[r]["loaded"]["state"][name][key], value, rtol=0, atol=0)
                torch.testing.assert_close(file["state"][name][key], value, rtol=0, atol=0)
