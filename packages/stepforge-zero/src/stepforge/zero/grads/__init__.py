# SPDX-License-Identifier: Apache-2.0
"""What a step does to this rank's reduced gradient pieces before the inner optimizer sees them.

- :mod:`.pieces`: synchronise once per step, scale, unscale (fp16 loss scaling), clip, drop.
- :mod:`.norm`: the global gradient norm over every rank's pieces and torch's clipping rule.
"""
