# SPDX-License-Identifier: Apache-2.0
"""The global gradient norm over every rank's pieces and torch's clipping rule (:mod:`.norm`); the pieces
themselves are :class:`stepforge.zero.comm.grad_reducer.GradPieces`."""
