# SPDX-License-Identifier: Apache-2.0
"""stepforge-fused's kernels as torch operators: ``torch.ops.stepforge_fused.<name>``.

Registered when :mod:`stepforge.fused` is imported (``torch.library`` definitions over the pybind11 kernels; the
schemas are :data:`SCHEMAS`, the arguments are described in :mod:`stepforge.fused._operators`). The optimizers'
compiled steps call them; they can also be called directly, e.g.::

    >>> import stepforge.fused, torch
    >>> steps = torch.zeros(len(params))  # one count per parameter, advanced by the call
    >>> torch.ops.stepforge_fused.adam_(params, grads, exp_avgs, exp_avg_sqs, [], steps, 1e-3, None, 0.9, 0.999,
    ...     1e-8, 0.0, True, True, 1.0, None, None, False, False, 0)

:func:`available` says whether this torch could register them (``torch.library.register_fake``, torch >= 2.4);
without them a compiled optimizer step runs eagerly, with a warning.
"""

from __future__ import annotations

from ._operators import NAMESPACE, OPERATORS, SCHEMAS, available, unavailable_reason

__all__ = ["NAMESPACE", "OPERATORS", "SCHEMAS", "available", "unavailable_reason"]
