# SPDX-License-Identifier: Apache-2.0
"""The implementations of :mod:`stepforge.fused.ops`: argument checks, the layout cache and the kernel calls."""
