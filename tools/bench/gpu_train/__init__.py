# SPDX-License-Identifier: Apache-2.0
"""Training on one GPU: the largest GPT each memory scheme trains, tokens/s and MFU through Strategy/Booster against a
plain torch loop, and the step of ZeRO-2 + CPU offload split into its phases (each also runs tiny on the CPU)."""
