# SPDX-License-Identifier: Apache-2.0
"""What each rank holds, and its checkpoints.

- :mod:`.partition`: how parameters are cut into per-rank pieces (``torch.chunk`` layout, padding, partitions)
  and the master pieces; :func:`~.partition.plan_pieces` computes the geometry without allocating.
- :mod:`.inner`: the inner optimizer that steps the master pieces (built from a config, ``CPUAdam`` for CPU
  offload, its cache).
- :mod:`.full`: the full, gathered, world-size-independent state dict.
- :mod:`.named`: the sharded state dict for ``torch.distributed.checkpoint`` in the layout every plugin shares
  (keyed by parameter name, in each parameter's shape, this rank's piece only).
"""
