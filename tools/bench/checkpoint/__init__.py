# SPDX-License-Identifier: Apache-2.0
"""The cost of a committed checkpoint against raw torch.distributed.checkpoint."""
