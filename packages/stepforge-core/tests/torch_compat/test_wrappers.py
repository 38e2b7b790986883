# SPDX-License-Identifier: Apache-2.0
"""stepforge.core.torch_compat: every torch private it wraps still exists, and every wrapper still does its job.

A failure here after a torch update names the private and the torch version: update ``torch_compat`` (and only
it) for that version.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from stepforge.core import no_sync, supports_no_sync
from stepforge.core import torch_compat as compat
from stepforge.core.torch_compat.errors import private_changed
from stepforge.testing.distributed import requires_gloo, run_distributed

TORCH = torch.__version__


def _require(obj: Any, attribute: str, private: str) -> Any:
    """``obj.<attribute>``, or a failure naming the private and the torch version."""
    if not hasattr(obj, attribute):
        pytest.fail(f"torch {TORCH} no longer has {private}: update stepforge.core.torch_compat")
    return getattr(obj, attribute)


@pytest.mark.parametrize("private, resolve", compat.PRIVATE_APIS, ids=[p for p, _ in compat.PRIVATE_APIS])
def test_private_api_still_exists(private, resolve):
    try:
        found = resolve()
    except (AttributeError, ImportError, KeyError) as error:
        pytest.fail(f"torch {TORCH} no longer has {private} ({error!r}): update stepforge.core.torch_compat")
    assert found is not None, f"torch {TORCH}: {private} resolved to None"


def test_changed_private_error_names_private_and_version():
    error = private_changed("FSDPParam._orig_size", AttributeError("gone"))
    assert isinstance(error, RuntimeError)
    assert "FSDPParam._orig_size" in str(error) and TORCH in str(error) and "gone" in str(error)


def test_legacy_lr_scheduler_is_the_old_name_and_a_public_lr_scheduler():
    from torch.optim.lr_scheduler import LRScheduler, StepLR

    assert issubclass(compat.LegacyLRScheduler, LRScheduler)
    assert compat.LegacyLRScheduler.__name__ == "_LRScheduler", f"torch {TORCH} dropped _LRScheduler"
    # torch's own schedulers are no longer _LRScheduler instances: a subclass of it is needed to pass the check
    sched = StepLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1), 1)
    assert not isinstance(sched, compat.LegacyLRScheduler)


def test_is_compiled_module_tells_the_compile_wrapper_from_a_module_compiled_in_place():
    """torch.compile(module) returns a wrapper (keys prefixed ``_orig_mod.``); module.compile() keeps the
    module itself. Only the wrapper is reported, and compiling costs nothing until a call."""
    wrapped = torch.compile(nn.Linear(2, 2))
    assert compat.is_compiled_module(wrapped)
    assert isinstance(wrapped, compat.compiled_module_type())
    assert next(iter(wrapped.state_dict())).startswith("_orig_mod.")
    in_place = nn.Linear(2, 2)
    in_place.compile()
    assert not compat.is_compiled_module(in_place)
    assert not compat.is_compiled_module(nn.Linear(2, 2))
    assert not compat.is_compiled_module("not a module")


def test_dispatch_mode_sees_meta_operations_and_storage_ids_follow_views():
    seen = []

    class Log(compat.DispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    with Log():
        weight = nn.Parameter(torch.empty(3, 2, device="meta"))
        nn.init.normal_(weight)
    assert "aten.empty" in seen and "aten.normal_" in seen
    assert compat.storage_id(weight) == compat.storage_id(weight.data[1:]) == compat.storage_id(weight.t())
    assert compat.storage_id(weight) != compat.storage_id(torch.empty(3, 2, device="meta"))
    leaves, spec = compat.tree_flatten(((weight, 1), {"a": 2}))
    assert leaves[1:] == [1, 2] and compat.tree_unflatten(leaves, spec)[1] == {"a": 2}


def test_apply_in_place_keeps_tied_parameters():
    model = nn.Sequential(nn.Linear(2, 2, device="meta"), nn.Linear(2, 2, device="meta"))
    model[1].weight = model[0].weight
    tied = model[0].weight
    compat.apply_in_place(model, lambda t: torch.zeros_like(t, device="cpu"))
    assert model[0].weight is tied and model[1].weight is tied and tied.device.type == "cpu"


def test_view_base():
    flat = torch.arange(6.0)
    pieces = [flat[0:2], flat[2:6]]
    assert all(compat.view_base(p) is flat for p in pieces)
    assert compat.view_base(flat) is None
    assert compat.view_base(flat.clone()) is None


@pytest.mark.parametrize(
    "module, expected",
    [
        (nn.BatchNorm1d(3), True),
        (nn.BatchNorm2d(3), True),
        (nn.SyncBatchNorm(3), True),
        (nn.InstanceNorm2d(3, track_running_stats=True), True),
        (nn.LazyBatchNorm1d(), True),
        (nn.LayerNorm(3), False),
        (nn.GroupNorm(1, 3), False),
        (nn.Linear(3, 3), False),
        ("BatchNorm1d", False),
    ],
    ids=["bn1d", "bn2d", "syncbn", "instancenorm", "lazybn", "layernorm", "groupnorm", "linear", "string"],
)
def test_is_norm_with_running_stats(module, expected):
    assert compat.is_norm_with_running_stats(module) is expected


def test_queue_backward_callback_runs_once_after_every_hook():
    order: list[str] = []
    a = torch.ones(3, requires_grad=True)
    b = torch.ones(3, requires_grad=True)

    def hook(name: str):
        def fire(grad: torch.Tensor) -> None:
            order.append(name)
            if name == "a":  # queued from inside the backward, as ZeRO's gradient hooks do
                compat.queue_backward_callback(lambda: order.append("end"))

        return fire

    a.register_hook(hook("a"))
    b.register_hook(hook("b"))
    ((a * 2).sum() + (b * 3).sum()).backward()
    assert order[-1] == "end" and order.count("end") == 1
    assert sorted(order[:-1]) == ["a", "b"]


def test_flatten_state_dict_keys_are_dcp_paths():
    t1, t2, t3 = torch.zeros(1), torch.ones(2), torch.full((3,), 2.0)
    flat, mapping = compat.flatten_state_dict({"model": {"w": t1, "layers": {"0": t2}}, "step": t3})
    assert set(flat) == {"model.w", "model.layers.0", "step"}
    assert flat["model.w"] is t1 and flat["model.layers.0"] is t2 and flat["step"] is t3
    assert mapping["model.layers.0"] == ("model", "layers", "0")


def test_an_instance_state_dict_is_what_callers_get_and_dcp_helpers_step_around_it():
    import gc
    import weakref

    from torch.distributed.checkpoint import state_dict as dcp_state_dict
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    model = nn.Linear(2, 3)
    ref = weakref.ref(model)

    def doubled(*args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        module = ref()
        assert module is not None
        return {k: 2 * v for k, v in nn.Module.state_dict(module).items()}

    compat.set_instance_state_dict(model, doubled)
    assert torch.equal(model.state_dict()["weight"], 2 * model.weight.detach())
    through_dcp = get_model_state_dict(model)
    assert torch.equal(through_dcp["weight"], model.weight.detach()) and through_dcp.keys() == {
        "weight",
        "bias",
    }
    assert doubled in dcp_state_dict._patched_state_dict
    del model
    gc.collect()
    assert ref() is None and doubled not in dcp_state_dict._patched_state_dict  # no module kept alive


def test_plain_tensors_and_modules_are_not_torch_parallel():
    t = torch.zeros(2)
    assert not compat.is_dtensor(t) and compat.dtensor_local(t) is t
    model = nn.Linear(2, 2)
    assert compat.fsdp2_modules(model) == [] and list(compat.fsdp2_params(model)) == []
    assert not compat.is_ddp(model) and not compat.supports_gradient_sync_off(model)
    assert compat.gradient_sync_off(model) is None
    assert compat.fsdp2_module_type() is not None, f"torch {TORCH}: FSDPModule (FSDP2) not found"


def _dtensor_ddp_store(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    out: dict[str, Any] = {}
    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(8.0).reshape(4, 2)
    d = distribute_tensor(full, mesh, [Shard(0)])
    _require(d, "_local_tensor", "DTensor._local_tensor")
    local = compat.dtensor_local(d)
    out["is_dtensor"] = compat.is_dtensor(d) and isinstance(d, DTensor)
    out["same_object"] = local is compat.dtensor_local(d) and type(local) is torch.Tensor
    out["same_values"] = torch.equal(local, d.to_local()) and local.data_ptr() == d.to_local().data_ptr()
    local.add_(100.0)  # in place on the shard is in place on the DTensor
    out["full_after_add"] = d.full_tensor()

    store = compat.default_store()
    store.add("compat-arrivals", 1)
    dist.barrier()
    out["arrivals"] = store.add("compat-arrivals", 0)

    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(nn.Linear(2, 1, bias=False))
    x = torch.full((1, 2), float(rank + 1))
    out["ddp_supported"] = compat.is_ddp(ddp) and supports_no_sync(ddp)
    with no_sync(ddp):
        ddp(x).sum().backward()
    out["grad_local"] = ddp.module.weight.grad.clone()
    ddp.module.weight.grad = None
    ddp(x).sum().backward()
    out["grad_synced"] = ddp.module.weight.grad.clone()
    return out


@requires_gloo
@pytest.mark.distributed
def test_dtensor_default_store_and_ddp_no_sync():
    results = run_distributed(_dtensor_ddp_store, 2, timeout=90.0)
    expected_full = torch.arange(8.0).reshape(4, 2) + 100.0
    for rank, out in enumerate(results):
        assert out["is_dtensor"] and out["same_object"] and out["same_values"], (
            f"torch {TORCH}: DTensor, {rank}"
        )
        assert torch.equal(out["full_after_add"], expected_full)
        assert out["arrivals"] == 2
        assert out["ddp_supported"]
        # d(sum(w.x))/dw = x: local under no_sync, the rank mean outside
        assert torch.equal(out["grad_local"], torch.full((1, 2), float(rank + 1)))
        assert torch.equal(out["grad_synced"], torch.full((1, 2), 1.5))


def _sharded_model(mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)  # a plain root holding two FSDP2 blocks
    return model


def _fsdp2_window(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    model = _sharded_model(mesh)
    out: dict[str, Any] = {"shapes": [tuple(p.shape) for p in model.parameters()]}
    out["modules"] = len(compat.fsdp2_modules(model))
    out["supported"] = supports_no_sync(model) and compat.supports_gradient_sync_off(model)
    x = torch.full((3, 4), float(rank + 1))
    with no_sync(model):
        model(x).sum().backward()
    params = list(compat.fsdp2_params(model))
    for fp in params[:1]:
        _require(fp, "_orig_size", "FSDPParam._orig_size")
        _require(fp, "_unsharded_param", "FSDPParam._unsharded_param")
    out["param_shapes"] = [tuple(compat.fsdp2_param_shape(fp)) for fp in params]
    pending = [compat.fsdp2_pending_grad(fp) for fp in params]
    out["pending"] = [None if g is None else g.detach().clone() for g in pending]
    out["no_sharded_grads_inside"] = all(p.grad is None for p in model.parameters())
    # the switch is back on after the block: this backward reduce-scatters the window's two micro-batches
    model(x).sum().backward()
    out["window_grads"] = [p.grad.full_tensor() for p in model.parameters()]
    out["nothing_pending_after"] = all(compat.fsdp2_pending_grad(fp) is None for fp in params)

    # resume: a fresh model is handed the pending gradients, then runs the window's last micro-batch
    resumed = _sharded_model(mesh)
    for fp, g in zip(compat.fsdp2_params(resumed), out["pending"], strict=True):
        compat.set_fsdp2_pending_grad(fp, g.clone())  # FSDP2 accumulates into it in place
    resumed(x).sum().backward()
    out["resumed_grads"] = [p.grad.full_tensor() for p in resumed.parameters()]
    return out


@requires_gloo
@pytest.mark.distributed
def test_fsdp2_no_sync_and_pending_gradients():
    results = run_distributed(_fsdp2_window, 2, timeout=120.0)
    for rank, out in enumerate(results):
        assert out["modules"] == 2 and out["supported"]
        assert out["param_shapes"] == out["shapes"], f"torch {TORCH}: FSDPParam._orig_size, rank {rank}"
        # inside no_sync nothing is reduce-scattered: no sharded grads, every unsharded gradient is pending
        assert out["no_sharded_grads_inside"]
        assert all(
            g is not None and tuple(g.shape) == s for g, s in zip(out["pending"], out["shapes"], strict=True)
        )
        assert out["nothing_pending_after"]
    local = [out["pending"] for out in results]
    assert not torch.equal(local[0][0], local[1][0]), (
        "rank inputs differ: the test must tell local from synced"
    )
    for i in range(len(local[0])):
        # two equal micro-batches per rank, averaged over the ranks
        expected = (2 * local[0][i] + 2 * local[1][i]) / 2
        for out in results:
            torch.testing.assert_close(out["window_grads"][i], expected)
            torch.testing.assert_close(out["resumed_grads"][i], expected)


class _Touch:
    """Unpickled by plain pickle, this creates a file: the stand-in for code carried by a checkpoint."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        import pathlib

        return (pathlib.Path.touch, (pathlib.Path(self.path),))


def test_safe_dcp_reader_and_planner_read_dcp_and_refuse_other_globals(tmp_path):
    import pickle
    import warnings

    import torch.distributed.checkpoint as dcp

    marker = str(tmp_path / "ran")
    good = {"w": torch.arange(4.0, dtype=torch.bfloat16), "lr": 0.5, "betas": (0.9, 0.99)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(good, checkpoint_id=str(tmp_path / "good"), no_dist=True)
        dcp.save(
            {"w": torch.zeros(4), "lr": _Touch(marker)}, checkpoint_id=str(tmp_path / "entry"), no_dist=True
        )
        meta = compat.SafeFileSystemReader(str(tmp_path / "good")).read_metadata()
        assert tuple(meta.state_dict_metadata["w"].size) == (4,)
        assert meta.state_dict_metadata["w"].properties.dtype == torch.bfloat16
        out = {"w": torch.zeros(4, dtype=torch.bfloat16), "lr": 0.0, "betas": (0.0, 0.0)}
        dcp.load(
            out,
            storage_reader=compat.SafeFileSystemReader(str(tmp_path / "good")),
            planner=compat.SafeLoadPlanner(),
            no_dist=True,
        )
        assert torch.equal(out["w"], good["w"]) and out["lr"] == 0.5 and tuple(out["betas"]) == (0.9, 0.99)
        with pytest.raises(dcp.CheckpointException, match="Unsupported global"):
            dcp.load(
                {"w": torch.zeros(4), "lr": 0.0},
                storage_reader=compat.SafeFileSystemReader(str(tmp_path / "entry")),
                planner=compat.SafeLoadPlanner(),
                no_dist=True,
            )
    with open(tmp_path / "good" / ".metadata", "wb") as f:
        pickle.dump(_Touch(marker), f)
    with pytest.raises(pickle.UnpicklingError, match="pathlib.Path.touch, which is not a DCP metadata class"):
        compat.SafeFileSystemReader(str(tmp_path / "good")).read_metadata()
    assert not (tmp_path / "ran").exists()
