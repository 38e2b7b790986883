# SPDX-License-Identifier: Apache-2.0
"""stepforge-fused's CPU kernels against torch's fused and foreach optimizers."""
