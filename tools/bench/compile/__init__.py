# SPDX-License-Identifier: Apache-2.0
"""The ``torch.compile`` benches: compiled optimizer steps and a compiled training step through ``Strategy``."""
