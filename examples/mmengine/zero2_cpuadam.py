# SPDX-License-Identifier: Apache-2.0
# mmengine FlexibleRunner config: ZeRO-2 + stepforge CPUAdam + gradient accumulation, on CPU (gloo) or GPU.
# Run: torchrun --nproc-per-node 2 examples/mmengine/train.py examples/mmengine/zero2_cpuadam.py
custom_imports = dict(imports=["stepforge.mmengine", "toy_regression"], allow_failed_imports=False)

model = dict(type="ToyRegressor", features=8, hidden=16)
train_dataloader = dict(
    dataset=dict(type="ToyRegressionDataset", size=64),
    # InfiniteSampler: one DataLoader iterator for the whole run. With DefaultSampler, mmengine's resume skips
    # batches by iterating, and each epoch boundary it crosses builds a new iterator, which draws a seed from
    # torch's global RNG after the strategy restored it: the resumed run's dropout masks then differ.
    sampler=dict(type="InfiniteSampler", shuffle=True),
    collate_fn=dict(type="default_collate"),
    batch_size=4,
    num_workers=0,
)
train_cfg = dict(by_epoch=False, max_iters=24)
# stepforge's wrapper drives the ZeRO-2 plugin: no_sync on non-final micro-batches, one step per 2 micro-batches
optim_wrapper = dict(
    type="StepforgeColossalAIOptimWrapper",
    optimizer=dict(type="StepforgeCPUAdam", lr=1e-2, weight_decay=0.01),
    accumulative_counts=2,
)
# mmengine semantics: iteration schedulers step every micro-batch
param_scheduler = [dict(type="LinearLR", start_factor=0.25, by_epoch=False, begin=0, end=8)]
# fp32 on CPU: the zero plugins default to fp16 (ColossalAI's default), whose loss scale starts at 2**32
strategy = dict(type="StepforgeStrategy", plugin=dict(type="zero2", precision="fp32"))
default_hooks = dict(
    checkpoint=dict(type="CheckpointHook", interval=12, by_epoch=False),
    logger=dict(type="LoggerHook", interval=4),
)
launcher = "pytorch"
env_cfg = dict(dist_cfg=dict(backend="gloo"))
randomness = dict(seed=0)
work_dir = "work_dirs/zero2_cpuadam"
