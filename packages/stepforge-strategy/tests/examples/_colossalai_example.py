# SPDX-License-Identifier: Apache-2.0
"""ColossalAI's examples/images/resnet/train.py, shrunk, with its ``colossalai`` imports pointed at stepforge and
``.cuda()`` replaced by the accelerator's device; run by test_colossalai_example.py under torchrun.

The structure and the calls are the example's (``launch_from_torch``, ``DistCoordinator``, ``priority_execution``
around the dataset "download", ``plugin.prepare_dataloader``, ``get_accelerator().get_current_device()``,
``booster.boost`` with criterion and scheduler, ``booster.backward``, checkpoints every ``--interval`` epochs,
resume, evaluation with ``all_reduce`` and ``is_master``); the model is a small CNN and the data a synthetic
10-class image set written to ``$DATA`` on first use (the "download").

The imports, ColossalAI's -> here: ``colossalai`` -> ``stepforge.strategy`` (``launch_from_torch``);
``colossalai.accelerator.get_accelerator``, ``colossalai.booster.Booster``, ``colossalai.cluster.DistCoordinator``,
``colossalai.booster.plugin.TorchDDPPlugin`` -> ``stepforge.strategy``; ``colossalai.booster.plugin.dp_plugin_base
.DPPluginBase`` -> ``stepforge.strategy.plugins``; ``LowLevelZeroPlugin`` -> ``stepforge.zero``;
``colossalai.nn.optimizer.HybridAdam`` -> ``stepforge.fused``. Added for stepforge: the data loader's position on
resume (marked below).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import MultiStepLR
from torch.utils.data import DataLoader, TensorDataset
from tqdm import tqdm

import stepforge.strategy as colossalai
from stepforge.fused import HybridAdam
from stepforge.strategy import Booster, DistCoordinator, TorchDDPPlugin, get_accelerator
from stepforge.strategy.plugins import DPPluginBase
from stepforge.zero import LowLevelZeroPlugin

NUM_EPOCHS = 3
LEARNING_RATE = 1e-3


def _download(root: Path, train: bool) -> TensorDataset:
    """The dataset files under ``root`` (written once, by the first process to get here)."""
    path = root / ("train.pt" if train else "test.pt")
    if not path.exists():
        print(f"downloading {path.name}", flush=True)
        g = torch.Generator().manual_seed(0)
        centres = torch.randn(10, 3, 8, 8, generator=g)
        g.manual_seed(1 if train else 2)
        labels = torch.randint(0, 10, (400 if train else 200,), generator=g)
        images = centres[labels] + 2.5 * torch.randn(len(labels), 3, 8, 8, generator=g)
        root.mkdir(parents=True, exist_ok=True)
        torch.save({"images": images, "labels": labels}, path.with_suffix(".tmp"))
        os.replace(path.with_suffix(".tmp"), path)
    data = torch.load(path, weights_only=True)
    return TensorDataset(data["images"], data["labels"])


def build_dataloader(batch_size: int, coordinator: DistCoordinator, plugin: DPPluginBase):
    data_path = Path(os.environ.get("DATA", "./data"))
    with coordinator.priority_execution():
        train_dataset = _download(data_path, train=True)
        test_dataset = _download(data_path, train=False)
    train_dataloader = plugin.prepare_dataloader(
        train_dataset, batch_size=batch_size, shuffle=True, drop_last=True
    )
    test_dataloader = plugin.prepare_dataloader(
        test_dataset, batch_size=batch_size, shuffle=False, drop_last=False
    )
    return train_dataloader, test_dataloader


@torch.no_grad()
def evaluate(model: nn.Module, test_dataloader: DataLoader, coordinator: DistCoordinator) -> float:
    model.eval()
    correct = torch.zeros(1, dtype=torch.int64, device=get_accelerator().get_current_device())
    total = torch.zeros(1, dtype=torch.int64, device=get_accelerator().get_current_device())
    for images, labels in test_dataloader:
        images = images.to(get_accelerator().get_current_device())  # was: images.cuda()
        labels = labels.to(get_accelerator().get_current_device())
        outputs = model(images)
        _, predicted = torch.max(outputs.data, 1)
        total += labels.size(0)
        correct += (predicted == labels).sum().item()
    dist.all_reduce(correct)
    dist.all_reduce(total)
    accuracy = correct.item() / total.item()
    if coordinator.is_master():
        print(f"Accuracy of the model on the test images: {accuracy * 100:.2f} %")
    return accuracy


def train_epoch(
    epoch, model, optimizer: Optimizer, criterion, train_dataloader, booster, coordinator
) -> None:
    model.train()
    with tqdm(
        train_dataloader, desc=f"Epoch [{epoch + 1}/{NUM_EPOCHS}]", disable=not coordinator.is_master()
    ) as pbar:
        for images, labels in pbar:
            images = images.to(get_accelerator().get_current_device())
            labels = labels.to(get_accelerator().get_current_device())
            outputs = model(images)
            loss = criterion(outputs, labels)
            booster.backward(loss, optimizer)
            optimizer.step()
            optimizer.zero_grad()
            pbar.set_postfix({"loss": loss.item()})


def main() -> None:
    global NUM_EPOCHS, LEARNING_RATE
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "-p", "--plugin", type=str, default="torch_ddp", choices=["torch_ddp", "low_level_zero"]
    )
    parser.add_argument("-r", "--resume", type=int, default=-1, help="resume from the epoch's checkpoint")
    parser.add_argument("-c", "--checkpoint", type=str, default="./checkpoint", help="checkpoint directory")
    parser.add_argument("-i", "--interval", type=int, default=1, help="interval of saving checkpoint")
    parser.add_argument("-e", "--epochs", type=int, default=NUM_EPOCHS)
    args = parser.parse_args()
    NUM_EPOCHS = args.epochs

    if args.interval > 0:
        Path(args.checkpoint).mkdir(parents=True, exist_ok=True)

    colossalai.launch_from_torch(seed=42)
    coordinator = DistCoordinator()
    coordinator.print_on_master(f"world size {coordinator.world_size}")
    LEARNING_RATE *= coordinator.world_size

    if args.plugin == "torch_ddp":
        plugin = TorchDDPPlugin()
    else:
        plugin = LowLevelZeroPlugin(initial_scale=2**5)
    booster = Booster(plugin=plugin)

    train_dataloader, test_dataloader = build_dataloader(20, coordinator, plugin)

    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 10)
    )
    criterion = nn.CrossEntropyLoss()
    optimizer = HybridAdam(model.parameters(), lr=LEARNING_RATE)
    lr_scheduler = MultiStepLR(optimizer, milestones=[2, 4], gamma=1 / 3)

    model, optimizer, criterion, _, lr_scheduler = booster.boost(
        model, optimizer, criterion=criterion, lr_scheduler=lr_scheduler
    )

    if args.resume >= 0:
        booster.load_model(model, f"{args.checkpoint}/model_{args.resume}.pth")
        booster.load_optimizer(optimizer, f"{args.checkpoint}/optimizer_{args.resume}.pth")
        booster.load_lr_scheduler(lr_scheduler, f"{args.checkpoint}/lr_scheduler_{args.resume}.pth")
        # stepforge's loader reshuffles every epoch (DistributedSampler.set_epoch), so its position is resumed too;
        # ColossalAI's never sets the epoch (the same order every epoch) and has nothing to resume
        train_dataloader.load_state_dict({"epoch": args.resume, "batches_yielded": 0})
        args.checkpoint = f"{args.checkpoint}/resumed"  # the resumed run writes apart, to be compared
        Path(args.checkpoint).mkdir(parents=True, exist_ok=True)

    start_epoch = args.resume if args.resume >= 0 else 0
    for epoch in range(start_epoch, NUM_EPOCHS):
        train_epoch(epoch, model, optimizer, criterion, train_dataloader, booster, coordinator)
        lr_scheduler.step()
        if args.interval > 0 and (epoch + 1) % args.interval == 0:
            booster.save_model(model, f"{args.checkpoint}/model_{epoch + 1}.pth")
            booster.save_optimizer(optimizer, f"{args.checkpoint}/optimizer_{epoch + 1}.pth")
            booster.save_lr_scheduler(lr_scheduler, f"{args.checkpoint}/lr_scheduler_{epoch + 1}.pth")

    evaluate(model, test_dataloader, coordinator)


if __name__ == "__main__":
    main()
