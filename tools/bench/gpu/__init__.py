# SPDX-License-Identifier: Apache-2.0
"""stepforge-fused's CUDA kernels against torch's CUDA optimizers (needs a CUDA device)."""
