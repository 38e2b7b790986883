# SPDX-License-Identifier: Apache-2.0
"""What each rank holds (:mod:`.partition`: the per-rank pieces and masters), and its checkpoints (:mod:`.dicts`:
the full state dict and the sharded one every plugin shares)."""
