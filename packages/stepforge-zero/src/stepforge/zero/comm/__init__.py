# SPDX-License-Identifier: Apache-2.0
"""Everything ZeRO sends between ranks.

- :mod:`.grad_reducer`: gradients taken from backward hooks, bucketed and reduced into this rank's pieces
  (:class:`~.grad_reducer.GradReducer`), how a bucket travels (:class:`~.grad_reducer.WireFormat`: as it is, cast
  to ``communication_dtype``, or as fp8 bytes) and what a step does to the pieces
  (:class:`~.grad_reducer.GradPieces`).
- :mod:`.algorithm`: which collective reduces a bucket (``reduce_scatter``, ``all_reduce``, ``all_to_all``), which
  gathers the parameters, and the default bucket size per backend.
- :mod:`.buffers`: the bucket buffers and gradient-piece storage reused from step to step, and how a bucket is laid
  out (rank-major rows).
- :mod:`.param_gather`: the updated pieces gathered into every rank's working parameters after a step.
- :mod:`.collectives`: torch's tensor collectives under the names this torch prefers, and small all-reduces.
- :mod:`.grid`: ColossalAI's ``extra_dp_group``: the process group over a 2-D grid of ranks.
- :mod:`.arrival`: a bounded wait, through the rendezvous store, for every rank to reach a collective call.

The sharding these modules read (slots, pieces, partitions) is in :mod:`stepforge.zero.state.partition`.
"""
