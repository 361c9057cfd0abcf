"""Device-side working-set tracker for decoding requests (SparseServe §3.3; pure torch, no sglang).

Working set of a decoding request = the distinct units ``(layer, KV head, block)`` it selected in its
last ``window`` decode steps. :class:`WorkingSetTracker` keeps, per tracked request slot, the step at
which each unit was last selected, so recording a step is one scatter per layer (fixed shapes: safe
inside a CUDA graph) and the working-set size is one comparison + count, done only when the
scheduler decides an admission (not per step):

  ``stamp_buf`` int32 ``[num_slots + 1, num_layers, num_kv_heads, max_blocks + 1]``
      step number (of that slot's own step counter) at which the unit was last selected; ``-2**30``
      = never. Row ``num_slots`` is the trash row of untracked batch rows, column ``max_blocks`` the
      trash column of unselected ranks. Memory: ``(num_slots + 1) * layers * kv_heads *
      (max_blocks + 1) * 4`` bytes (:attr:`nbytes`; logged by the caller).
  ``step_buf`` int32 ``[num_slots + 1]`` decode steps recorded per slot.

Host side (once per batch, in planning): :meth:`assign` maps the batch rows' request keys (any
hashable, e.g. SGLang rids) to slots, giving a new key a free slot (its stamps reset) or the trash
row when all slots are taken, and releases the slots of keys absent from a decode batch (in SGLang
every running request decodes in every decode batch, so an absent key finished or was retracted).
:meth:`plan_rows` copies the rows' slots into the fixed ``slot_buf``; :meth:`begin_step` advances
their step counters on the device. Per layer, :meth:`record` takes the selector's rank order and read
counts (PSA: ``PsaDecodeWrapper.order`` / ``nread``) and scatters the step into the selected units:
through an injected fused kernel (``record_kernel``; the PSA runner passes
:func:`flashinfer_ext.host_tier.ws_record.ws_record` on CUDA: one launch per layer) or through preallocated index
buffers (a few torch ops); no allocation, no sync either way. :meth:`record_tokens` takes a selector that names
tokens instead (LoopServe: per-(row, KV head) token lists) and marks each listed token's block (``token //
block_size``), through an injected ``token_record_kernel`` (the LoopServe runner passes
:func:`flashinfer_ext.host_tier.ws_record.ws_record_tokens` on its kernel path, its torch reference on the CPU reference path).

Cautions: a request whose steps were not recorded (untracked: no free slot, or dense decode through
the stock kernel) has size ``None`` from :meth:`sizes`; callers count its whole context.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import torch

__all__ = ["WorkingSetTracker"]

_NEVER = -(1 << 30)


def _positive(name: str, v: int, hi: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= hi:
        raise ValueError(f"WorkingSetTracker.{name}={v!r} is out of range: expected an integer in [1, {hi}]")


class WorkingSetTracker:
    """Last-selected step per (slot, layer, KV head, block); see the module docstring."""

    def __init__(self, *, num_slots: int, num_layers: int, num_kv_heads: int, max_blocks: int, window: int,
                 max_batch_size: int, device: torch.device | str = "cpu", record_kernel=None,
                 token_record_kernel=None, order_buffers: bool = True) -> None:
        """``order_buffers`` False: no index buffers for :meth:`record`'s torch path (a tracker fed only
        through :meth:`record_tokens` / :meth:`record_rows`)."""
        _positive("num_slots", num_slots, 1 << 16)
        _positive("num_layers", num_layers, 1 << 12)
        _positive("num_kv_heads", num_kv_heads, 1 << 12)
        _positive("max_blocks", max_blocks, 1 << 24)
        _positive("window", window, 1 << 16)
        _positive("max_batch_size", max_batch_size, 1 << 20)
        dev = torch.device(device)
        self.num_slots, self.num_layers, self.num_kv_heads = num_slots, num_layers, num_kv_heads
        self.max_blocks, self.window, self.max_batch_size, self.device = max_blocks, window, max_batch_size, dev
        self.trash = num_slots
        self._cols = max_blocks + 1
        self.stamp_buf = torch.full((num_slots + 1, num_layers, num_kv_heads, self._cols), _NEVER,
                                    dtype=torch.int32, device=dev)
        self.step_buf = torch.zeros(num_slots + 1, dtype=torch.int32, device=dev)
        self.slot_buf = torch.full((max_batch_size,), num_slots, dtype=torch.int64, device=dev)
        # record_kernel(stamp, order, nread, base, row_step, layer_off): a fused one-launch writer with the
        # contract of flashinfer_ext.host_tier.ws_record.ws_record (injected: this package stays pure torch); None = the
        # torch path below, whose index buffers are only allocated then
        self.record_kernel = record_kernel
        # token_record_kernel(stamp, lists, lens, base, row_step, layer_off, block_size=, max_blocks=): the contract
        # of flashinfer_ext.host_tier.ws_record.ws_record_tokens (or its torch reference); required by record_tokens
        self.token_record_kernel = token_record_kernel
        n = 0 if record_kernel is not None or not order_buffers else max_batch_size * num_kv_heads * max_blocks
        self._rank_buf = torch.arange(max_blocks, dtype=torch.int32, device=dev)
        self._valid_buf = torch.empty(n, dtype=torch.bool, device=dev)
        self._idx_buf = torch.empty(n, dtype=torch.int64, device=dev)
        self._row_step_buf = torch.zeros(max_batch_size, dtype=torch.int32, device=dev)
        self._base_buf = torch.zeros(max_batch_size, num_kv_heads, dtype=torch.int64, device=dev)
        self._head_off = torch.arange(num_kv_heads, dtype=torch.int64, device=dev) * self._cols
        self._ones_buf = torch.ones(max_batch_size, dtype=torch.int32, device=dev)
        self._trash_col = torch.tensor(max_blocks, dtype=torch.int64, device=dev)
        self._slot_of: dict[Hashable, int] = {}
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._bs = 0
        self._ncols = 0

    @property
    def nbytes(self) -> int:
        return self.stamp_buf.numel() * 4 + self._valid_buf.numel() * 9

    @property
    def tracked(self) -> dict[Hashable, int]:
        """Key -> slot of the requests tracked now (a copy)."""
        return dict(self._slot_of)

    # ------------------------------------------------------------------ host planning (once per batch)
    def assign(self, keys: Sequence[Hashable | None], release_absent: bool = True) -> list[int]:
        """Slots of a decode batch's rows (``None`` key or no free slot -> the trash row)."""
        if release_absent:
            live = {k for k in keys if k is not None}
            for k in [k for k in self._slot_of if k not in live]:
                self._free.append(self._slot_of.pop(k))
        slots, fresh = [], []
        for k in keys:
            s = self._slot_of.get(k) if k is not None else self.trash
            if s is None:
                s = self._free.pop() if self._free else self.trash
                if s != self.trash:
                    self._slot_of[k] = s
                    fresh.append(s)
            slots.append(s)
        if fresh:
            idx = torch.tensor(fresh, dtype=torch.int64).to(self.device)
            self.stamp_buf.index_fill_(0, idx, _NEVER)
            self.step_buf.index_fill_(0, idx, 0)
        return slots

    def release(self, keys: Sequence[Hashable]) -> None:
        for k in keys:
            s = self._slot_of.pop(k, None)
            if s is not None:
                self._free.append(s)

    def plan_rows(self, slots: Sequence[int], num_cols: int | None = None, pad_to: int | None = None) -> None:
        """Copy the rows' slots into ``slot_buf`` (rows ``len(slots)..pad_to`` -> trash) and fix the width
        ``num_cols`` (<= ``max_blocks``; None: ``max_blocks``, e.g. for :meth:`record_tokens`, which takes no rank
        orders) of the rank orders :meth:`record` will get."""
        bs = len(slots) if pad_to is None else pad_to
        num_cols = self.max_blocks if num_cols is None else num_cols
        if not len(slots) <= bs <= self.max_batch_size or not 0 < num_cols <= self.max_blocks:
            raise ValueError(f"plan_rows: {len(slots)} rows (pad {pad_to}) / {num_cols} columns exceed the "
                             f"tracker's max_batch_size {self.max_batch_size} / max_blocks {self.max_blocks}")
        host = torch.full((bs,), self.trash, dtype=torch.int64)
        host[: len(slots)] = torch.tensor(list(slots), dtype=torch.int64)
        self.slot_buf[:bs].copy_(host.to(self.device, non_blocking=True))
        self._bs, self._ncols = bs, num_cols

    # ------------------------------------------------------------------ device (per step / per layer)
    def begin_step(self) -> None:
        """Advance the step counter of the planned rows' slots and stage the per-row scatter bases and
        values (device ops only; once per decode step, before the layers)."""
        bs, c = self._bs, self._ncols
        slots = self.slot_buf[:bs]
        self.step_buf.index_add_(0, slots, self._ones_buf[:bs])
        self.step_buf[self.trash] = 0
        per_slot = self.num_layers * self.num_kv_heads * self._cols
        torch.add(self._head_off[None, :], slots[:, None] * per_slot, out=self._base_buf[:bs])
        torch.index_select(self.step_buf, 0, slots, out=self._row_step_buf[:bs])

    def record(self, layer: int, order: torch.Tensor, nread: torch.Tensor) -> None:
        """Mark the units read at this step in ``layer``.

        order: ``[bs, num_kv_heads, num_cols]`` int64 block columns in rank order (the first ``nread``
            were read); nread: ``[bs, num_kv_heads]`` int32/int64 blocks read per (row, KV head).
        """
        bs, h, c = self._bs, self.num_kv_heads, self._ncols
        if order.shape != (bs, h, c) or nread.shape != (bs, h):
            raise ValueError(f"record: order {tuple(order.shape)} / nread {tuple(nread.shape)} do not match the "
                             f"plan ({bs}, {h}, {c})")
        if self.record_kernel is not None:
            self.record_kernel(self.stamp_buf, order, nread, self._base_buf[:bs], self._row_step_buf[:bs],
                               layer * h * self._cols)
            return
        n = bs * h * c
        if self._valid_buf.numel() < n:
            raise RuntimeError("record: this tracker was built without order_buffers and without a record_kernel")
        valid = self._valid_buf[:n].view(bs, h, c)
        torch.lt(self._rank_buf[:c].view(1, 1, c), nread.view(bs, h, 1), out=valid)
        idx = self._idx_buf[:n].view(bs, h, c)
        torch.where(valid, order, self._trash_col, out=idx)
        idx.add_(self._base_buf[:bs].view(bs, h, 1))
        idx.add_(layer * h * self._cols)
        self.stamp_buf.view(-1).index_put_((idx,), self._row_step_buf[:bs].view(bs, 1, 1))

    def record_tokens(self, layer: int, lists: torch.Tensor, lens: torch.Tensor | None, block_size: int) -> None:
        """Mark the blocks of the tokens read at this step in ``layer``.

        lists: ``[bs, num_kv_heads, width]`` int32 token positions per planned row and KV head (``-1`` padded);
        lens: ``[bs, num_kv_heads]`` int32 valid entries per list (None: every entry ``>= 0`` is valid); a token's
        unit is ``(layer, KV head, token // block_size)``. Tokens past ``max_blocks`` blocks are skipped.
        """
        bs, h = self._bs, self.num_kv_heads
        if lists.shape[:2] != (bs, h) or (lens is not None and lens.shape != (bs, h)):
            raise ValueError(f"record_tokens: lists {tuple(lists.shape)} / lens "
                             f"{None if lens is None else tuple(lens.shape)} do not match the plan ({bs}, {h})")
        if self.token_record_kernel is None:
            raise RuntimeError("record_tokens: this tracker was built without a token_record_kernel")
        self.token_record_kernel(self.stamp_buf, lists, lens, self._base_buf[:bs], self._row_step_buf[:bs],
                                 layer * h * self._cols, block_size=block_size, max_blocks=self.max_blocks)

    def record_rows(self, layer: int, rows: torch.Tensor, order: torch.Tensor, nread: torch.Tensor) -> None:
        """Eager variant for a subset of the planned rows (e.g. the CPU reference's sparse rows):
        ``rows`` int64 ``[r]`` batch rows, ``order`` ``[r, num_kv_heads, cols]``, ``nread`` ``[r, num_kv_heads]``."""
        slots = self.slot_buf[: self._bs].index_select(0, rows.to(self.device))
        r, h, c = order.shape
        valid = torch.arange(c, device=self.device).view(1, 1, c) < nread.to(self.device).view(r, h, 1)
        col = torch.where(valid, order.to(self.device), self.max_blocks)
        per_slot = self.num_layers * h * self._cols
        base = slots[:, None] * per_slot + layer * h * self._cols + self._head_off[None, :]
        vals = self.step_buf.index_select(0, slots).view(r, 1, 1)
        self.stamp_buf.view(-1).index_put_((col + base[:, :, None],), vals)

    # ------------------------------------------------------------------ admission time (syncs once)
    def sizes(self, keys: Sequence[Hashable]) -> list[int | None]:
        """Working-set sizes (units) of the requests ``keys``; ``None`` for untracked ones or ones with no
        recorded step. One device->host copy for all of them."""
        slots = [self._slot_of.get(k) for k in keys]
        have = [s for s in slots if s is not None]
        if not have:
            return [None] * len(keys)
        idx = torch.tensor(have, dtype=torch.int64).to(self.device)
        stamps = self.stamp_buf.index_select(0, idx)[..., : self.max_blocks]
        steps = self.step_buf.index_select(0, idx)
        live = stamps > (steps - self.window).view(-1, 1, 1, 1)
        counts = torch.stack([live.flatten(1).sum(1), steps.to(torch.int64)], 1).tolist()
        by_slot = {s: (n if st > 0 else None) for s, (n, st) in zip(have, counts)}
        return [None if s is None else by_slot[s] for s in slots]
