# SPDX-License-Identifier: Apache-2.0
"""The step machinery of the fused optimizers: buckets and their pointer cache (:mod:`.buckets`), the eager
step on the host (:mod:`.eager`) and on CUDA without host syncs (:mod:`.device`), the compiled step
(:mod:`.compiled`) and what they need from the optimizer (:mod:`.protocol`)."""
