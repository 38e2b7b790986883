# SPDX-License-Identifier: Apache-2.0
"""Train an mmengine config with FlexibleRunner: ``torchrun --nproc-per-node 2 train.py CONFIG [--resume]``."""

from __future__ import annotations

import argparse
import os
import sys

from mmengine.config import Config
from mmengine.runner import FlexibleRunner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("config", help="an mmengine config file, e.g. zero2_cpuadam.py")
    parser.add_argument("--work-dir", help="overrides the config's work_dir")
    parser.add_argument("--resume", action="store_true", help="resume from work_dir's last checkpoint")
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # custom_imports finds toy_regression
    cfg = Config.fromfile(args.config)
    if args.work_dir:
        cfg.work_dir = args.work_dir
    cfg.resume = args.resume
    runner = FlexibleRunner.from_cfg(cfg)
    runner.train()


if __name__ == "__main__":
    main()
