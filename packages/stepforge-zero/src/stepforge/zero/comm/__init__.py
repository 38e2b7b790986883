# SPDX-License-Identifier: Apache-2.0
"""Everything ZeRO sends between ranks: the gradient reduction (:mod:`.grad_reducer`, its choice of collective
and bucket size in :mod:`.algorithm`, its reused storage and bucket layout in :mod:`.buffers`), the parameter
gather after a step (:mod:`.param_gather`) and ColossalAI's ``extra_dp_group`` grid (:mod:`.grid`). The sharding
they read is :mod:`stepforge.zero.state.partition`."""
