# SPDX-License-Identifier: Apache-2.0
"""On a GPU: ``get_accelerator()`` is the CUDA one and its members answer for the device; ``launch_from_torch``
keeps a 1-rank NCCL group and binds the GPU; ``torch_fsdp``'s model ``state_dict()`` is the full state as plain
CUDA tensors, a snapshot."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu


def test_the_cuda_accelerator_answers_for_the_device() -> None:
    from stepforge.strategy import Accelerator

    cuda = Accelerator("cuda")
    assert (cuda.name, cuda.communication_backend, cuda.support_set_device) == ("cuda", "nccl", True)
    assert cuda.is_available() and cuda.device_count() == torch.cuda.device_count()
    assert cuda.get_current_device() == torch.device("cuda", torch.cuda.current_device())
    assert cuda.current_device() == torch.cuda.current_device()
    cuda.set_device(0)
    assert cuda.get_current_device() == torch.device("cuda", 0)
    before = cuda.memory_allocated()
    block = torch.empty(2**20, dtype=torch.float32, device="cuda")
    cuda.synchronize()
    assert cuda.memory_allocated() - before >= block.numel() * 4
    assert cuda.max_memory_allocated() >= cuda.memory_allocated()
    del block
    cuda.empty_cache()
    cuda.reset_peak_memory_stats()
    assert cuda.max_memory_allocated() == cuda.memory_allocated()
    cuda.manual_seed(3)
    first = torch.rand(4, device="cuda")
    cuda.manual_seed(3)
    assert torch.equal(torch.rand(4, device="cuda"), first)


def _fsdp_on_cuda(rank: int, world: int) -> dict:
    from stepforge.strategy import Booster, get_accelerator, launch_from_torch
    from stepforge.testing.models import block_net, regression_batch

    launch_from_torch(seed=5)  # keeps the launcher's NCCL group, binds the GPU
    device = get_accelerator().get_current_device()
    booster = Booster(plugin="torch_fsdp")
    net = block_net(0)
    model, opt, *_ = booster.boost(net, torch.optim.SGD(net.parameters(), lr=0.1))
    x, y = regression_batch(8, 6, 1, seed=0)
    F.mse_loss(model(x.to(device)), y.to(device)).backward()
    opt.step()
    opt.zero_grad()
    first = model.state_dict()
    kept = {k: v.clone() for k, v in first.items()}
    F.mse_loss(model(x.to(device)), y.to(device)).backward()
    opt.step()
    return {
        "device": str(device),
        "types": {type(v) for v in first.values()},
        "devices": {v.device.type for v in first.values()},
        "kept": all(torch.equal(first[k], kept[k]) for k in first),
        "moved": all(not torch.equal(first[k], v) for k, v in model.state_dict().items()),
    }


def test_fsdp_state_dict_on_cuda_is_a_full_snapshot() -> None:
    from stepforge.testing.gpu import run_on_one_gpu

    out = run_on_one_gpu(_fsdp_on_cuda)
    assert out["device"] == "cuda:0" and out["types"] == {torch.Tensor} and out["devices"] == {"cuda"}
    assert out["kept"] and out["moved"]
