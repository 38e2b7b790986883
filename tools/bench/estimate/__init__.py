# SPDX-License-Identifier: Apache-2.0
"""The memory estimate (``stepforge.strategy.estimate``) against what each rank really holds."""
