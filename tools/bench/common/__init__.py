# SPDX-License-Identifier: Apache-2.0
"""Shared by every bench: thread setup and round-robin timing, bandwidth ceilings, machine info, reports,
the rank exit of the multi-process benches."""
