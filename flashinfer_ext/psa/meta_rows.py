"""Block-metadata rows for page size 1: a free list of rows and a device block table per request slot.

Supports: a KV pool of page size 1, where a request's logical block ``b`` (positions ``[b*B, (b+1)*B)``) has no
physical page to key its metadata by. :class:`MetaRowAllocator` hands each request slot (SGLang's
``req_pool_idx``) rows of a :class:`flashinfer_ext.psa.block_meta.BlockMetaPool` block by block, and keeps
``table_buf[slot, b]`` = the row of block ``b`` on the device, so the kernels' block table of a batch is one
device gather (``table_buf.index_select(0, req_pool_indices)``).

Host work: :meth:`acquire` per request and step (list operations), :meth:`flush` once per batch (one small
host->device copy and one ``index_put_``, only when rows were handed out). No device read, no sync.

Cautions:
  * Row 0 is the trash row: never handed out, the target of every table entry not allocated. A kernel reading
    it for a block past a request's length is masked by ``seq_lens``; a row without rows attends with epsilon 1.
  * Rows of a slot belong to its owner key. A different owner (the slot reused by a new request, a retraction)
    releases them first and reports the rows ``fresh``: their metadata must be rebuilt from position 0.
  * Rows of finished requests are not returned eagerly (nothing tells the attention backend a request ended):
    :meth:`reclaim` returns every slot outside a live set when the free list runs short.
  * Prefix sharing is not deduplicated: each request holds rows for its whole context.
"""

from __future__ import annotations

import torch

__all__ = ["MetaRowAllocator", "TRASH_ROW"]

TRASH_ROW = 0


class MetaRowAllocator:
    """Rows ``1..num_rows-1`` of a metadata pool handed to request slots block by block.

    Args:
      num_rows: rows of the metadata pool (row 0 included, never handed out).
      num_slots: request slots (``req_to_token`` rows).
      max_blocks_per_req: blocks of the longest context (``table_buf``'s width).
      device: where ``table_buf`` lives.

    ``table_buf``: ``[num_slots, max_blocks_per_req]`` int32 on ``device``: slot, logical block -> meta row
    (``TRASH_ROW`` where nothing is allocated).
    """

    def __init__(self, num_rows: int, num_slots: int, max_blocks_per_req: int, device: str | torch.device = "cpu"):
        if num_rows < 2:
            raise ValueError(f"num_rows={num_rows} must be >= 2 (row 0 is the trash row)")
        if num_slots < 1 or max_blocks_per_req < 1:
            raise ValueError(f"num_slots={num_slots} and max_blocks_per_req={max_blocks_per_req} must be >= 1")
        self.num_rows = int(num_rows)
        self.num_slots = int(num_slots)
        self.max_blocks_per_req = int(max_blocks_per_req)
        self.table_buf = torch.full((num_slots, max_blocks_per_req), TRASH_ROW, dtype=torch.int32, device=device)
        self._free: list[int] = list(range(self.num_rows - 1, 0, -1))  # pop() hands out low rows first
        self._rows: dict[int, list[int]] = {}     # slot -> rows of its blocks 0..n-1
        self._owner: dict[int, object] = {}       # slot -> owner key
        self._pending: list[tuple[int, int, int]] = []  # (slot, block, row) not yet in table_buf

    @property
    def free_rows(self) -> int:
        return len(self._free)

    @property
    def used_rows(self) -> int:
        return self.num_rows - 1 - len(self._free)

    def rows_of(self, slot: int) -> list[int]:
        """The rows held by ``slot`` (block order; a copy)."""
        return list(self._rows.get(slot, ()))

    def owner_of(self, slot: int):
        return self._owner.get(slot)

    def release(self, slot: int) -> None:
        """Return ``slot``'s rows to the free list (its table entries are left stale: a new owner's acquire
        rewrites every entry it reads)."""
        rows = self._rows.pop(slot, None)
        self._owner.pop(slot, None)
        if rows:
            self._free.extend(reversed(rows))

    def reclaim(self, live_slots) -> int:
        """Release every slot not in ``live_slots``; returns the rows freed."""
        live = set(int(s) for s in live_slots)
        before = len(self._free)
        for slot in [s for s in self._rows if s not in live]:
            self.release(slot)
        return len(self._free) - before

    def acquire(self, slot: int, owner, n_blocks: int) -> tuple[bool, bool]:
        """Make ``slot`` hold rows for blocks ``0..n_blocks-1`` on behalf of ``owner``.

        Returns ``(ok, fresh)``: ``ok`` False when the free list is too short (nothing is handed out then);
        ``fresh`` True when the slot changed owner (its rows' metadata must be rebuilt from position 0).
        ``owner`` None never matches: every call is fresh.
        """
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot={slot} out of range [0, {self.num_slots})")
        if n_blocks > self.max_blocks_per_req:
            raise ValueError(f"n_blocks={n_blocks} exceeds max_blocks_per_req={self.max_blocks_per_req}")
        fresh = owner is None or self._owner.get(slot) != owner
        if fresh:
            self.release(slot)
            self._owner[slot] = owner
        rows = self._rows.setdefault(slot, [])
        need = int(n_blocks) - len(rows)
        if need <= 0:
            return True, fresh
        if need > len(self._free):
            return False, fresh
        for b in range(len(rows), len(rows) + need):
            row = self._free.pop()
            rows.append(row)
            self._pending.append((slot, b, row))
        return True, fresh

    def flush(self) -> None:
        """Write the rows handed out since the last flush into ``table_buf`` (one copy, one ``index_put_``)."""
        if not self._pending:
            return
        host = torch.tensor(self._pending, dtype=torch.int64).t().contiguous()  # [3, n]: slot, block, row
        self._pending = []
        dev = host.to(self.table_buf.device, non_blocking=True)
        self.table_buf.index_put_((dev[0], dev[1]), dev[2].to(torch.int32))

    def table(self, req_pool_indices: torch.Tensor, n_blocks: int) -> torch.Tensor:
        """``[batch, n_blocks]`` int32 block table of the slots ``req_pool_indices`` (device gather; allocates)."""
        n = max(1, min(int(n_blocks), self.max_blocks_per_req))
        return self.table_buf.index_select(0, req_pool_indices.long())[:, :n]
