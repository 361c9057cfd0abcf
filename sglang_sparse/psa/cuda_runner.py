"""PSA's CUDA runner (:class:`PsaCudaRunner`): block metadata beside the KV pool, kept current at sparse decode
steps, and decode through :class:`flashinfer_ext.psa.decode.PsaDecodeWrapper`. The batch bookkeeping it shares with
the CPU runner, the host-work budget and the CUDA-graph contract are described in :mod:`sglang_sparse.psa.runner`.
"""

from __future__ import annotations

import logging

import torch

from sglang_sparse.config import PsaConfig
from sglang_sparse.psa.runner import _META_ATTR, AttnShape, _meta_key, _row_rids, _RunnerBase
from sglang_sparse.psa.stats import COL_EPS, COL_KEPT, COL_READ, STEP_COLS
from sglang_sparse.request_params import batch_requests

logger = logging.getLogger("sglang_sparse")

class PsaCudaRunner(_RunnerBase):
    """GPU: block metadata beside the KV pool + :class:`PsaDecodeWrapper`.

    Page size > 1: the page is the block and its metadata row is the page id. Page size 1 (the stock default):
    a block is ``block_size`` consecutive positions of one request, and its metadata row comes from a
    :class:`flashinfer_ext.psa.meta_rows.MetaRowAllocator` (rows handed to a request slot at its sparse steps,
    ``table_buf[slot, block]`` on the device). A sparse row the allocator cannot serve attends its whole context
    that step (counted in ``meta_row_shortfalls``).

    Metadata is kept only where it is read: for rows that decode through PSA (the invariant: after
    any decode step at which a row is sparse, its blocks' metadata covers its whole context). Other
    rows cost nothing: a batch without a sparse row is the stock decode alone, and extends do no
    metadata work. A sparse row whose metadata does not cover its context up to the step (its first
    sparse step, a retraction since, a request the plan cannot identify) has it rebuilt from
    position 0 at plan time, all layers, outside any CUDA graph (:meth:`_plan_decode_meta`; a cached
    prefix is never trusted: a request that decoded densely left its pages without metadata). A row
    that stops being sparse (the adaptive switch) never becomes sparse again.
    """

    def __init__(self, cfg: PsaConfig, block_size: int, shape: AttnShape, device: torch.device, *,
                 token_to_kv_pool, req_to_token: torch.Tensor, max_batch_size: int, sm_scale: float,
                 out_dtype: torch.dtype, page_size: int | None = None, exact_stock_rows: bool = False):
        super().__init__(cfg, block_size, shape, device)
        from flashinfer_ext.psa.block_meta import BlockMetaPool
        from flashinfer_ext.psa.decode import PsaDecodeWrapper
        from flashinfer_ext.psa.key_sketch import KeySketchPool
        from flashinfer_ext.psa.meta_rows import MetaRowAllocator

        page_size = block_size if page_size is None else int(page_size)
        if page_size not in (1, block_size):
            raise ValueError(f"page_size={page_size} must be 1 or block_size ({block_size})")
        k0 = token_to_kv_pool.get_key_buffer(0)
        self.max_blocks_per_req = -(-req_to_token.shape[1] // block_size)
        # page > 1: one row per page (+1). page 1: rows for a KV pool's worth of blocks, plus one partial block per
        # batch row and the trash row
        num_rows = -(-k0.shape[0] // block_size) + 1 + (max_batch_size if page_size == 1 else 0)
        self.rows = (MetaRowAllocator(num_rows, req_to_token.shape[0], self.max_blocks_per_req, device)
                     if page_size == 1 else None)
        if self.kernel_cfg.criticality == "sketch":  # an int4 copy of every key, per block row
            self.meta = KeySketchPool(shape.num_layers, num_rows, shape.num_kv_heads, shape.head_dim, block_size,
                                      device=device)
        else:
            self.meta = BlockMetaPool(shape.num_layers, num_rows, shape.num_kv_heads, shape.head_dim, block_size,
                                      dtype=k0.dtype, device=device, layout=PsaDecodeWrapper.META_LAYOUT)
        self.pool = token_to_kv_pool
        self._req_to_token = req_to_token  # SGLang's ReqToTokenPool.req_to_token: one tensor for the server's life
        self._fresh_rows: set[int] = set()  # rows of the planned decode batch whose allocated metadata is new
        self._live_slots: set[int] = set()  # request slots of the last batch with a sparse row (kept by a reclaim)
        self.meta_row_shortfalls = 0         # sparse rows sent dense for want of metadata rows (page size 1)
        self.wrapper = PsaDecodeWrapper(
            self.kernel_cfg, num_qo_heads=shape.num_qo_heads, num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim, block_size=block_size, max_batch_size=max_batch_size,
            max_blocks_per_req=self.max_blocks_per_req, device=device, sm_scale=sm_scale, out_dtype=out_dtype,
            stat_slots=shape.num_layers)
        i32 = dict(dtype=torch.int32, device=device)
        self._step_buf = torch.zeros(max_batch_size, STEP_COLS, dtype=torch.float32, device=device)
        self._rpi_buf = torch.zeros(max_batch_size, **i32)          # fixed: read inside decode graphs
        self._table_buf = torch.zeros(max_batch_size, self.max_blocks_per_req, **i32)
        self._meta_start_buf = torch.zeros(max_batch_size, **i32)   # decode: per-row fold range
        self._meta_end_buf = torch.zeros(max_batch_size, **i32)
        # stock_rows 'exact': the rows of a sparse step that read PSA's output (epsilon < 1); the others take the
        # stock decode's, so their tokens do not depend on their batch (batch invariance under deterministic inference)
        self.exact_stock_rows = bool(exact_stock_rows)
        self._psa_out_buf = torch.zeros(max_batch_size, dtype=torch.bool, device=device)
        self._nread_sum_buf = torch.zeros(max_batch_size, dtype=torch.float32, device=device)
        self._kept_sum_buf = torch.zeros(max_batch_size, dtype=torch.float32, device=device)
        self.meta_rebuilds = 0        # rows whose metadata was rebuilt from position 0 (first sparse step, ...)
        self._xp = None               # device tensors of the current extend batch's prefill probes

    def meta_bytes(self) -> int:
        return self.meta.nbytes()

    def meta_report(self) -> dict:
        """Block-metadata counters for ``/server_info``: rows of the pool, rows held by requests (page size 1),
        requests whose metadata was rebuilt from position 0, sparse rows sent dense for want of rows."""
        rows = self.meta.num_rows
        return {"meta_rows_total": int(rows), "meta_rows_used": None if self.rows is None else self.rows.used_rows,
                "meta_rebuilds": int(self.meta_rebuilds), "meta_row_shortfalls": int(self.meta_row_shortfalls)}

    @property
    def page_is_block(self) -> bool:
        """Metadata rows are pages (page size > 1): the host tier's load listener applies."""
        return self.rows is None

    def rebuild_page_meta(self, pages: torch.Tensor) -> None:
        """Host tier load listener (page size > 1 only): recompute (min, max, mean) of whole pages ``pages`` (int64 ``[n]`` on the
        device, full pages of reloaded radix nodes) for every layer from the keys now in them (the metadata
        is recomputed from the reloaded KV, not carried through the host). The mean is taken in fp32 over
        the page, which may differ in the last bit from the kernel's incremental mean."""
        if self.rows is not None:
            raise RuntimeError("rebuild_page_meta: page size 1 keeps metadata per request, not per page")
        for lid in range(self.shape.num_layers):
            self.meta.rebuild_pages(lid, self.pool.get_key_buffer(lid), pages)

    def _block_table(self, req_pool_indices: torch.Tensor, max_len: int) -> torch.Tensor:
        """``[rows, ceil(max_len / block)]`` int32 page ids of the rows ``req_pool_indices``."""
        from flashinfer_ext.psa.block_meta import paged_block_table

        width = max(1, -(-int(max_len) // self.block_size))
        if self.rows is not None:
            return self.rows.table(req_pool_indices, width)
        return paged_block_table(self._req_to_token, req_pool_indices,
                                 self.block_size, width)

    def _acquire(self, slots: list, needs: list[int], owners: list, keep: set) -> list[tuple[bool, bool]]:
        """Page size 1: rows for ``needs[i]`` blocks of ``slots[i]`` (None: refused); one reclaim of the slots
        outside ``keep`` if the free list runs short. Returns ``(ok, fresh)`` per entry; flushes the table."""
        alloc, out = self.rows, []
        for slot, need, owner in zip(slots, needs, owners):
            if slot is None:
                out.append((False, True))
                continue
            ok, fresh = alloc.acquire(slot, owner, need)
            if not ok and alloc.reclaim(keep):
                ok, again = alloc.acquire(slot, owner, need)
                fresh = fresh or again
            if not ok:
                alloc.release(slot)  # nothing half-held: its next sparse step starts fresh
                self.meta_row_shortfalls += 1
                if self.meta_row_shortfalls in (1, 10, 100) or self.meta_row_shortfalls % 1000 == 0:
                    logger.warning("sglang-sparse psa: block metadata rows exhausted (%d rows, %d free); a row "
                                   "attends its whole context this step (%d times so far)", alloc.num_rows,
                                   alloc.free_rows, self.meta_row_shortfalls)
            out.append((ok, fresh))
        alloc.flush()
        return out

    def _admit_rows(self, sparse: list[bool], lens: list[int], reqs: list) -> list[bool]:
        """Page size 1: each sparse row's slot holds rows for its whole context before the step (host lists; one
        table flush). Rows without a known request slot, or that cannot get rows, attend their whole context."""
        if self.rows is None:
            return sparse
        self._fresh_rows = set()
        idx = [i for i, s in enumerate(sparse) if s]
        if not idx:  # no host work for a batch without a sparse row (its slots are not needed)
            return sparse
        slots = [_slot_of(r) for r in reqs]
        live = {s for s in slots if s is not None}
        got = self._acquire([slots[i] for i in idx], [-(-int(lens[i]) // self.block_size) for i in idx],
                            [_owner_of(reqs[i]) for i in idx], live | self._live_slots)
        sparse = list(sparse)
        for i, (ok, fresh) in zip(idx, got):
            sparse[i] = ok
            if ok and fresh:
                self._fresh_rows.add(i)
        self._live_slots = live
        return sparse

    def _admit_probe_rows(self, rows: list[int], forward_batch) -> list[int]:
        """Page size 1: rows for each prefill probe row's whole context (its first decode step reuses them); a row
        that cannot get them is not probed (it runs decode probe steps instead)."""
        if self.rows is None or not rows:
            return rows
        reqs = list(batch_requests(forward_batch) or ())
        lens = forward_batch.seq_lens_cpu
        slots = [_slot_of(reqs[i] if i < len(reqs) else None) for i in rows]
        got = self._acquire(slots, [-(-int(lens[i]) // self.block_size) for i in rows],
                            [_owner_of(reqs[i] if i < len(reqs) else None) for i in rows],
                            {s for s in slots if s is not None} | self._live_slots)
        return [i for i, (ok, _) in zip(rows, got) if ok]

    def _plan_decode_meta(self, backend, forward_batch, table: torch.Tensor) -> None:
        """Host plan of the metadata for a decode batch. A sparse row whose metadata does not cover its context
        up to this step's token (its first sparse step, a retraction since, a step it did not fold: a request
        not known for the row counts as such) has it rebuilt from position 0 now, for every layer, outside any
        CUDA graph; every sparse row folds this step's key in the forward (graph-safe)."""
        bs = self.bs
        lens = forward_batch.seq_lens_cpu
        lens = (forward_batch.seq_lens.cpu() if lens is None else lens)[:bs].to(torch.int64)  # None: capture
        long_rows = self._sparse_host[:bs]  # only rows that decode through PSA read (so keep) metadata
        stale = torch.zeros(bs, dtype=torch.bool)
        for i in torch.nonzero(long_rows).flatten().tolist():
            req, n = self._row_reqs[i] if i < len(self._row_reqs) else None, int(lens[i])
            if req is None or getattr(req, _META_ATTR, None) != _meta_key(req, n - 1) or i in self._fresh_rows:
                stale[i] = True
            if req is not None:
                setattr(req, _META_ATTR, _meta_key(req, n))  # covered through this step once its fold runs
        start = torch.where(long_rows, lens - 1, lens).to(torch.int32)
        self._meta_start_buf[:bs].copy_(start, non_blocking=True)
        self._meta_end_buf[:bs].copy_(lens.to(torch.int32), non_blocking=True)
        self._rpi_buf[:bs].copy_(forward_batch.req_pool_indices, non_blocking=True)
        self._table_buf[:bs, : table.shape[1]].copy_(table, non_blocking=True)
        self.meta_rebuilds += int(stale.sum())
        if bool(stale.any()):  # positions [0, len - 1) already written -> rebuild them
            from flashinfer_ext.psa.block_meta import blocks_touched

            ends = torch.where(stale, lens - 1, 0)
            n_new = blocks_touched([0] * bs, ends.tolist(), self.block_size)
            if n_new:
                zero = torch.zeros(bs, dtype=torch.int32, device=self.device)
                end_dev = ends.to(torch.int32).to(self.device, non_blocking=True)
                for lid in range(self.shape.num_layers):
                    self.meta.update(lid, self.pool.get_key_buffer(lid), self._req_to_token, self._rpi_buf[:bs],
                                     self._table_buf[:bs], zero, end_dev, n_new)

    def _fold_decode_meta(self, layer_id: int) -> None:
        """Fold this step's new key into its block's metadata, for rows that keep metadata (graph-safe)."""
        bs = self.bs
        self.meta.update(layer_id, self.pool.get_key_buffer(layer_id), self._req_to_token, self._rpi_buf[:bs],
                         self._table_buf[:bs], self._meta_start_buf[:bs], self._meta_end_buf[:bs], 1)

    def _plan_wrapper(self, forward_batch, table: torch.Tensor, max_len: int | None) -> None:
        """Plan the PSA wrapper: rows that are not sparse, and probe rows, read everything (epsilon 1.0); the probe
        threshold is each sparse row's epsilon (a probe row's reads at it land in ``probe_nread``).
        ``max_len`` None: the full ranking width (graphs)."""
        probe_eps = torch.where(self._sparse_host, self._eps_host, 1.0)
        both = torch.stack([torch.where(self._probe_host, 1.0, probe_eps), probe_eps])
        both = both.to(self.device, non_blocking=True)  # one copy: [epsilon; probe epsilon]
        if self.exact_stock_rows:  # rows whose output is PSA's (the sparse, non-probe rows); one launch per step
            torch.lt(both[0], 1.0, out=self._psa_out_buf[: both.shape[1]])
        self.wrapper.plan(self._req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens.to(torch.int32),
                          table, max_seq_len=max_len, epsilon=both[0], probe_epsilon=both[1])

    def begin_batch(self, backend, forward_batch) -> None:
        mode = forward_batch.forward_mode
        if mode.is_idle() or int(forward_batch.batch_size) == 0:
            self.bs, self.sparse_batch, self.is_decode, self.graph_mode = 0, False, False, False
            return
        # decode batches without a sparse row: no metadata work. A request's decode metadata is built at its first
        # sparse decode step (_plan_decode_meta). Extends run the stock prefill (and SGLang's prefill CUDA graphs),
        # except those with a prefill probe (eager, see _plan_extend_probe_device)
        self._plan_rows(forward_batch, mode.is_decode())
        self._xp = None
        if not mode.is_decode():
            if self._plan_extend_probe(forward_batch):
                self._plan_extend_probe_device(forward_batch)
            return
        if not self.sparse_batch:
            return
        max_len = int(forward_batch.seq_lens_cpu[: self.bs].max())
        table = self._block_table(forward_batch.req_pool_indices, max_len)
        self._plan_decode_meta(backend, forward_batch, table)
        self._plan_wrapper(forward_batch, table, max_len)
        self._plan_ws(_row_rids(forward_batch, self.bs), self.wrapper._num_cols)

    def begin_graph_batch(self, backend, forward_batch, in_capture: bool) -> None:
        """Plan a decode batch that captures or replays a CUDA graph (host side, before the graph).

        Fixed shapes and buffers: the full ranking width (``max_blocks_per_req``), ``_step_buf``,
        ``_rpi_buf``, ``_table_buf`` and the fold ranges; every row takes the PSA path inside the
        graph, rows that are not sparse with epsilon 1.0.
        """
        bs = int(forward_batch.batch_size)
        self._plan_rows(forward_batch, True, state=None if in_capture else self._stashed_state(forward_batch, bs),
                        tensor_rows=True)
        if self._sparse_host is None:  # no sparse row (a capture, or rows the gate did not expect): every row
            self._row_tensors()        # takes the PSA path in the graph with epsilon 1.0
        self.graph_mode, self.sparse_batch = True, True
        self._step_buf[:bs].copy_(self.step_rows, non_blocking=True)
        self.step_rows = self._step_buf[:bs]
        table = self._block_table(forward_batch.req_pool_indices, self.max_blocks_per_req * self.block_size)
        self._plan_decode_meta(backend, forward_batch, table)
        self._plan_wrapper(forward_batch, table, None)
        # the graph records into the tracker at every replay (fixed shapes): rows without a known request
        # (capture, padding, a replay view that does not match the stash) write the tracker's trash row
        rids = None if in_capture else self._stashed_rids(forward_batch, bs)
        self._plan_ws(rids if rids is not None else [None] * bs, self.wrapper._num_cols, pad_to=bs)

    def _plan_extend_probe_device(self, forward_batch) -> None:
        """Device plan of the prefill probes (once per extend batch, eager): the probe rows' block table, the
        wrapper planned over them at their epsilon (its output is discarded), their query indices, and the step
        rows on the device for the per-layer read counts."""
        rows = self._xp_rows
        dev = self.device
        idx = torch.tensor(rows, dtype=torch.long)
        lens_host = forward_batch.seq_lens_cpu[idx].to(torch.int64)
        rpi = forward_batch.req_pool_indices[idx.to(forward_batch.req_pool_indices.device)]
        seq_lens = lens_host.to(torch.int32).to(dev, non_blocking=True)
        table = self._block_table(rpi, int(lens_host.max()))
        eps = self.step_rows[idx, COL_EPS].clone()
        from flashinfer_ext.psa.block_meta import blocks_touched

        n = len(rows)
        self._xp = dict(rows=idx.to(dev), qidx=torch.tensor(self._xp_qidx_host, dtype=torch.long).to(dev),
                        rpi=rpi.to(torch.int32), table=table, zero=torch.zeros(n, dtype=torch.int32, device=dev),
                        end=seq_lens, n_new=blocks_touched([0] * n, lens_host.tolist(), self.block_size),
                        nread_sum=torch.zeros(n, dtype=torch.float32, device=dev))
        self.wrapper.plan(self._req_to_token, rpi, seq_lens, table, max_seq_len=int(lens_host.max()),
                          epsilon=eps.to(dev, non_blocking=True))
        self.step_rows = self.step_rows.to(dev, non_blocking=True)

    def after_extend(self, backend, q, layer, forward_batch) -> None:
        """Prefill probes (extends planned with them only; eager): this layer's block metadata over each probe
        row's whole context, then PSA's stop test for the row's last prompt query; the blocks it reads are added to
        the row's step statistics. The wrapper's output is discarded (the prefill stays stock)."""
        xp = self._xp
        if xp is None:
            return None
        lid = layer.layer_id
        k_buf, v_buf = self.pool.get_key_buffer(lid), self.pool.get_value_buffer(lid)
        self.meta.update(lid, k_buf, self._req_to_token, xp["rpi"], xp["table"], xp["zero"], xp["end"], xp["n_new"])
        num_qo, d = layer.tp_q_head_num, layer.head_dim
        q_rows = q.reshape(-1, num_qo, d).index_select(0, xp["qidx"])
        self.wrapper.run(q_rows, k_buf, v_buf, *self.meta.layer(lid), slot=lid)
        if lid == self.shape.num_layers - 1:  # every layer's reads, summed once
            torch.sum(self.wrapper.probe_nread_slots, (0, 2), dtype=torch.float32, out=xp["nread_sum"])
            self.step_rows[:, COL_READ].index_add_(0, xp["rows"], xp["nread_sum"])
        return None

    def decode(self, backend, q, k, v, layer, forward_batch, save_kv_cache):
        pool = backend.token_to_kv_pool
        lid = layer.layer_id
        if not self.sparse_batch and not self.graph_mode:
            # no sparse row: stock decode, no metadata (a request's metadata is rebuilt at its next sparse step)
            return backend._psa_base.forward_decode(backend, q, k, v, layer, forward_batch, save_kv_cache)
        stock = None
        if self.exact_stock_rows:  # the stock decode of the whole batch (it writes the new K/V): the stock rows' output
            stock = backend._psa_base.forward_decode(backend, q, k, v, layer, forward_batch, save_kv_cache)
        elif k is not None and save_kv_cache:
            _write_kv(backend, pool, layer, forward_batch, k, v)
        k_buf, v_buf = pool.get_key_buffer(lid), pool.get_value_buffer(lid)
        self._fold_decode_meta(lid)
        num_qo, d = layer.tp_q_head_num, layer.head_dim
        o, _, nread = self.wrapper.run(q.reshape(-1, num_qo, d), k_buf, v_buf, *self.meta.layer(lid), slot=lid)
        if lid == self.shape.num_layers - 1:
            # statistics of every layer at once (in-place, into preallocated buffers; four launches per step, not
            # per layer). Blocks read at each row's epsilon: a sparse row's reads; a probe row's had it run sparsely
            rows, bs = self.step_rows, self.bs
            torch.sum(self.wrapper.probe_nread_slots, (0, 2), dtype=torch.float32, out=self._nread_sum_buf[:bs])
            torch.sum(self.wrapper.kept_est_slots, (0, 2), out=self._kept_sum_buf[:bs])
            rows[:, COL_READ].add_(self._nread_sum_buf[:bs])
            rows[:, COL_KEPT].add_(self._kept_sum_buf[:bs])
        if self._ws_step:  # working set: one index_put into the tracker (graph-safe, no sync)
            self.ws.record(lid, self.wrapper.order, nread)
        o = o.reshape(-1, num_qo * d)
        if stock is not None:  # PSA's output on its rows, the stock one elsewhere (in place, no allocation)
            stock = stock.view(o.shape)
            torch.where(self._psa_out_buf[: o.shape[0], None], o, stock, out=stock)
            return stock
        return o


def _slot_of(req) -> int | None:
    """A scheduler ``Req``'s request slot (``req_pool_idx``), or None (no request, slot released)."""
    slot = getattr(req, "req_pool_idx", None) if req is not None else None
    return None if slot is None else int(slot)


def _owner_of(req):
    """Who a slot's metadata rows belong to: the request and its retraction count (a retraction re-prefills)."""
    return getattr(req, "rid", None), int(getattr(req, "retraction_count", 0) or 0)


def _write_kv(backend, pool, layer, forward_batch, k, v) -> None:
    """Write the decode token's K/V exactly as the stock FlashInfer backend does."""
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    swa = getattr(getattr(backend, "forward_metadata", None), "swa_out_cache_loc", None)
    scales = backend._kv_write_scales(layer) if hasattr(backend, "_kv_write_scales") else (layer.k_scale, layer.v_scale)
    pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, swa), k, v, *scales)
