"""Working-set estimator and working-set-aware admission (SparseServe §3.3; pure torch, no sglang).

Working set of a decoding request = the union of the units (or blocks: any non-negative integer ids,
e.g. ``HostBlockPool`` unit ids) it selected in its last ``w`` decode steps (paper default w = 12:
the overlap with the current step's selection plateaus there). ``WorkingSetEstimator`` keeps, per
request slot, a ring of the last ``w`` step selections in one preallocated buffer
``ring_buf`` int32 ``[max_requests, w, max_selected]`` (``-1`` = padding / empty step; ids < 2**31;
memory ``max_requests * w * max_selected * 4`` bytes) and a write position ``pos_buf`` int64
``[max_requests]``:

  * ``record(req_slots [B], selected [B, S])`` writes each row's selection (``-1`` padded, S <=
    max_selected) into that request's next ring position, vectorised over the batch;
  * ``sizes(req_slots [B])`` -> int64 ``[B]`` distinct ids in each request's ring (one sort of the
    flattened ring rows; ``O(B * w * S log)``, no python loop over requests);
  * ``union(req_slot)`` the distinct ids themselves; ``reset(req_slots)`` empties rings (request done).

``admit(sizes, capacity)`` is Alg. 1 lines 6-14: walk the candidates in their order, add one while the
running sum of working sets stays <= capacity, otherwise queue it (it is never dropped; the caller
keeps it waiting for a later step). ``stop_at_first_miss=True`` keeps strict FCFS (queue everything
after the first request that does not fit). Progress guarantee: when nothing fits and there is at
least one candidate, the first one is admitted alone (``oversize=True``): its own working set
exceeds the cache, so it runs thrashing rather than starving.

Cautions: ids are counted as given (pass globally unique ids such as unit ids that include the
layer, or the count is per layer); a step that selects nothing should still be recorded (an all
``-1`` row) so old selections age out of the window.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["WorkingSetEstimator", "Admission", "admit"]


def _int_in(name: str, val, lo: int, hi: int) -> None:
    if isinstance(val, bool) or not isinstance(val, int) or not lo <= val <= hi:
        raise ValueError(f"WorkingSetEstimator.{name}={val!r} is out of range: expected an integer in "
                         f"[{lo}, {hi}]")


class WorkingSetEstimator:
    """Union of the last ``window`` step selections per request slot (see module docstring)."""

    def __init__(self, window: int = 12, max_requests: int = 256, max_selected: int = 4096,
                 device: torch.device | str = "cpu") -> None:
        _int_in("window", window, 1, 256)
        _int_in("max_requests", max_requests, 1, 1 << 20)
        _int_in("max_selected", max_selected, 1, 1 << 24)
        self.window, self.max_requests, self.max_selected = window, max_requests, max_selected
        self.ring_buf = torch.full((max_requests, window, max_selected), -1, dtype=torch.int32, device=device)
        self.pos_buf = torch.zeros(max_requests, dtype=torch.int64, device=device)

    def _slots(self, req_slots: torch.Tensor) -> torch.Tensor:
        if not isinstance(req_slots, torch.Tensor) or req_slots.dim() != 1 or req_slots.dtype.is_floating_point:
            raise ValueError("req_slots must be a 1-D integer tensor")
        return req_slots.to(self.ring_buf.device, torch.int64)

    def record(self, req_slots: torch.Tensor, selected: torch.Tensor) -> None:
        """One decode step: ``selected[b]`` (int ``[S]``, ``-1`` padded; duplicates allowed) are the
        ids request ``req_slots[b]`` read this step. ``req_slots`` must be distinct."""
        r = self._slots(req_slots)
        if selected.dim() != 2 or selected.shape[0] != r.numel() or selected.shape[1] > self.max_selected:
            raise ValueError(f"selected must be [len(req_slots)={r.numel()}, S <= max_selected="
                             f"{self.max_selected}], got {tuple(selected.shape)}")
        s = selected.to(self.ring_buf.device, torch.int64)
        if s.numel() and int(s.max()) >= 2**31:
            raise ValueError("selected ids must be < 2**31")
        pos = self.pos_buf[r]
        row = torch.full((r.numel(), self.max_selected), -1, dtype=torch.int32, device=s.device)
        row[:, :s.shape[1]] = s.clamp(min=-1).to(torch.int32)
        self.ring_buf[r, pos] = row
        self.pos_buf[r] = (pos + 1) % self.window

    def reset(self, req_slots: torch.Tensor) -> None:
        """Forget these requests' history (finished, aborted or retracted)."""
        r = self._slots(req_slots)
        self.ring_buf[r] = -1
        self.pos_buf[r] = 0

    def sizes(self, req_slots: torch.Tensor) -> torch.Tensor:
        """int64 ``[B]``: distinct ids each request selected over its last ``window`` steps."""
        r = self._slots(req_slots)
        flat = self.ring_buf[r].view(r.numel(), -1)
        s = flat.sort(dim=1).values
        valid = s >= 0
        new = torch.ones_like(valid)
        new[:, 1:] = s[:, 1:] != s[:, :-1]
        return (valid & new).sum(dim=1)

    def union(self, req_slot: int) -> torch.Tensor:
        """int64 sorted distinct ids of one request's working set."""
        v = self.ring_buf[req_slot].flatten()
        return torch.unique(v[v >= 0]).to(torch.int64)


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
