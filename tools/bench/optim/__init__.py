# SPDX-License-Identifier: Apache-2.0
"""stepforge-optim's pure-Python optimizers against a per-parameter loop of the same math."""
