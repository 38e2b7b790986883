# SPDX-License-Identifier: Apache-2.0
"""What each rank holds, and its checkpoints.

- :mod:`.partition`: how parameters are cut into per-rank pieces (``torch.chunk`` layout, padding, partitions)
  and the master pieces.
- :mod:`.dicts`: the full, gathered, world-size-independent state dict, and the sharded one for
  ``torch.distributed.checkpoint`` in the layout every plugin shares (keyed by parameter name, in each
  parameter's shape, this rank's piece only).
"""
