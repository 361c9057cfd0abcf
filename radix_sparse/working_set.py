"""Working-set-aware admission rule (SparseServe §3.3, Alg. 1; pure python, no sglang).

``admit(sizes, capacity)`` is Alg. 1 lines 6-14: walk the candidates in their order, add one while the
running sum of working sets stays <= capacity, otherwise queue it (it is never dropped; the caller
keeps it waiting for a later step). ``stop_at_first_miss=True`` keeps strict FCFS (queue everything
after the first request that does not fit). Progress guarantee: when nothing fits and there is at
least one candidate, the first one is admitted alone (``oversize=True``): its own working set
exceeds the cache, so it runs thrashing rather than starving.

The working sets themselves (units a decoding request read in its last ``w`` steps) are measured on
the device by :class:`radix_sparse.working_set_tracker.WorkingSetTracker`; the scheduler side is
``sglang_sparse.host_tier.admission``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["Admission", "admit"]


@dataclass(frozen=True)
class Admission:
    """Which candidates (indices into the candidate list, in order) run this step and which wait."""

    admitted: tuple[int, ...]
    queued: tuple[int, ...]
    used: int
    capacity: int
    oversize: bool = False


def admit(sizes: Sequence[int] | torch.Tensor, capacity: int, *, stop_at_first_miss: bool = False) -> Admission:
    """SparseServe Alg. 1 over candidate working-set sizes (see module docstring). Never drops a
    candidate: ``admitted`` + ``queued`` is a partition of ``range(len(sizes))``, each in order."""
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
        raise ValueError(f"capacity={capacity!r} is out of range: expected an integer >= 0")
    vals = sizes.tolist() if isinstance(sizes, torch.Tensor) else list(sizes)
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in vals):
        raise ValueError("sizes must be non-negative integers")
    admitted: list[int] = []
    queued: list[int] = []
    used = 0
    blocked = False
    for i, v in enumerate(vals):
        if not blocked and used + v <= capacity:
            admitted.append(i)
            used += v
        else:
            queued.append(i)
            blocked = blocked or stop_at_first_miss
    oversize = False
    if not admitted and vals:
        admitted, queued, used, oversize = [0], queued[1:], vals[0], True
    return Admission(tuple(admitted), tuple(queued), used, capacity, oversize)
