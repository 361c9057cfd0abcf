"""CUDA-graph decode for LoopServe / lastwindow: replay SGLang's decode graphs at the steady steps.

A steady step is a decode step where every row of the batch is a sparse decode row whose prefill is done and
no row selects top-B (loopserve: 15 of every ``n_d`` = 16 steps after generated token 16; lastwindow: every
step after its first). Such a step's per-layer work is two device operations with no host decision: the copy
of the step's queries into the ring buffer and the split-list sparse decode over lists planned for all layers
before the forward (:meth:`sglang_sparse.loopserve.runner.LoopServeRunner.decode`). Those run inside SGLang's
captured decode graph over static buffers owned here:

  * ``lists_buf [L, max_bs, num_kv_heads, W]`` int32 / ``lens_buf [L, max_bs, num_kv_heads]`` int32: every
    layer's token lists (``W`` = the config's ``graph_list_width``); rows past the real batch have length 0;
  * ``q_buf [L, max_bs, num_qo_heads, head_dim]``: the step's queries (loopserve only), committed to the
    requests' rings at the next batch as in the eager path;
  * the decode wrapper's fixed buffers (:class:`~flashinfer_ext.loopserve.decode.VerticalSlashDecode`: lengths,
    side outputs and the split-decode partials; split plan fixed per captured
    batch size from ``W``, the same at capture and replay).

Host flow: ``DecodeCudaGraphRunner.can_run_graph`` -> :meth:`LoopServeGraphs.wants_graph` (the real batch: is
it steady, are its lists at most ``W`` wide? keeps the batch for the replay planning) -> SGLang's
``load_batch`` -> ``init_forward_metadata_out_graph(view)`` -> :meth:`LoopServeGraphs.plan` (the eager planning
of the kept batch, then one copy of its lists / lengths / lengths into the static buffers) -> graph replay.
A step's working set (host tier admission, :mod:`sglang_sparse.loopserve.ws`) is recorded inside the graph from
``lists_buf`` into the tracker's fixed buffers, planned here before each replay. Every other step (prefill, re-selection, lists wider than ``W``, a batch larger than the captured ones)
runs eagerly. Batches without a sparse row replay SGLang's stock graph, recorded beside the sparse one
(:mod:`sglang_sparse.graph_variants`). Captured batch sizes above the config's ``graph_max_bs`` record the
stock decode in both variants. Memory: ``lists_buf`` + ``lens_buf`` take ``L * max_bs * num_kv_heads * (W + 1) * 4`` bytes,
``max_bs`` = the largest captured size <= ``graph_max_bs`` (logged at allocation).
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from flashinfer_ext.loopserve.decode import VerticalSlashDecode
from sglang_sparse.loopserve.stats import STEP_COLS
from sglang_sparse.request_params import batch_requests, host_ints

__all__ = ["LoopServeGraphs"]

logger = logging.getLogger("sglang_sparse")


class LoopServeGraphs:
    """Static buffers and planning of the graph-replayed decode steps of one :class:`LoopServeRunner`."""

    def __init__(self, runner, list_width: int | None = None, stats=None, max_bs: int = 16, select_rows: int = 0):
        """``list_width`` defaults to the runner's ``split_width`` (the config's ``graph_list_width``);
        ``select_rows`` > 0 (loopserve): re-selecting steps with up to this many selecting rows replay graphs too."""
        list_width = runner.split_width if list_width is None else list_width
        if list_width < 1:
            raise ValueError(f"graph_list_width={list_width} must be >= 1 to replay decode graphs")
        if max_bs < 1:
            raise ValueError(f"graph_max_bs={max_bs} must be >= 1 to replay decode graphs")
        self.runner = runner
        self.width = list_width
        self.bs_cap = max_bs               # captured batch sizes above it record the stock decode, never replayed
        self.stats = stats                 # LoopServeStats: graph_decode_steps
        self.max_bs = 0
        self._dicts: dict[int, dict] = {}  # per captured batch size: the decode dict the graph recorded
        self._pending = None               # (forward batch, reqs, lens, variant) kept for plan()
        self._decided = (None, None)       # (forward batch, variant) of the last graph_variant answer
        self.select_rows = 0 if runner.lastwindow else int(select_rows)
        self._select: dict[int, dict] = {}  # per captured batch size: the re-selecting decode dict it recorded
        self.replays = 0                   # steps planned for a graph replay (statistics, tests)
        self.select_replays = 0            # of which re-selecting steps
        self.dense_replays = 0             # steps that replayed the stock graph (no sparse row)

    # ------------------------------------------------------------------ host test (can_run_graph)
    def wants_graph(self, forward_batch) -> bool:
        """True when the batch is a steady step (see the module docstring) that fits the captured buffers;
        then keeps it for :meth:`plan`. Host ints only, no device work."""
        from sglang_sparse.loopserve.runner import STATE_ATTR

        self._pending = None
        r = self.runner
        bs = int(forward_batch.batch_size)
        reqs = batch_requests(forward_batch)
        lens = forward_batch.seq_lens_cpu
        if not forward_batch.forward_mode.is_decode() or bs == 0 or bs > self.max_bs or reqs is None \
                or len(reqs) != bs or lens is None:
            return False
        needs_init = getattr(forward_batch, "needs_forward_metadata_init", None)
        if needs_init is not None and not needs_init():  # pre-planned elsewhere: plan() would not run
            return False
        lens = host_ints(lens, bs)
        wv = ws = wb = tail = 0
        for req, n in zip(reqs, lens):
            st = getattr(req, STATE_ATTR, None)
            if st is None or not st.prefill_done or st.lines is None or r.row_fires(st, n)[1]:
                return False  # not sparse yet, lines not compacted yet (first decode step), or selecting
            wv, ws = max(wv, st.lines[0].shape[2]), max(ws, st.lines[2].shape[2])
            wb = max(wb, 0 if st.topb is None else st.topb.shape[2])
            tail = max(tail, n - (st.since or st.prompt_len))
        # the planned lists are [L, bs, Hk, summed widths], deduplicated: no list is longer than its context, so
        # the static buffer takes the first min(summed widths, longest context) entries (the rest is padding). On
        # the kernel path they are written straight into it (runner.steady_into): no all-layer temporary to cap
        summed = max(wv, 1) + max(ws, 1) + max(wb, 1) + r.cfg.sink_tokens + tail
        if min(summed, max(lens)) > self.width or not (r.steady_into_static or r.lists_all_fits(bs, summed)):
            return False
        self._pending = (forward_batch, reqs, lens, "sparse")
        return True

    def graph_variant(self, forward_batch, peek: bool = False) -> str | None:
        """Which decode graph this batch replays: ``"sparse"`` (a steady step, :meth:`wants_graph`), ``"dense"``
        (no row is sparse: SGLang's stock graph, :mod:`sglang_sparse.graph_variants`) or None (eager). Keeps the
        batch for :meth:`plan`; ``peek``: answer for the batch already kept, keep nothing new."""
        if peek:  # SGLang asks again while loading the batch, after plan() took the kept batch
            fb, variant = self._decided
            return variant if fb is forward_batch else None
        v = self._decide(forward_batch)
        self._decided = (forward_batch, v)
        return v

    def wants_select(self, forward_batch) -> bool:
        """True when the batch is a re-selecting step that a captured re-selecting graph takes: every row a sparse
        decode row, at most the graph's ``f_cap`` rows selecting, each observing exactly ``n_d`` queries with a
        budget <= the graph's top-B width, every context <= the static list width, every kept top-B <= that
        width. Keeps the batch for :meth:`plan`. Host ints only (a request's first decode step compacts its
        prefill lines here, one host read, as its eager planning would)."""
        from sglang_sparse.loopserve.runner import STATE_ATTR

        self._pending = None
        if not self._select:
            return False
        r = self.runner
        bs = int(forward_batch.batch_size)
        reqs = batch_requests(forward_batch)
        lens = forward_batch.seq_lens_cpu
        if not forward_batch.forward_mode.is_decode() or bs == 0 or reqs is None or len(reqs) != bs or lens is None:
            return False
        sizes = [k for k in self._select if k >= bs]
        if not sizes:
            return False
        needs_init = getattr(forward_batch, "needs_forward_metadata_init", None)
        if needs_init is not None and not needs_init():
            return False
        sel = self._select[min(sizes)]["sel"]
        lens = host_ints(lens, bs)
        n_fire = 0
        for req, n in zip(reqs, lens):
            st = getattr(req, STATE_ATTR, None)
            if st is None or not st.prefill_done or n > self.width:
                return False
            st.finalize()
            if st.lines is None:
                return False
            if r.row_fires(st, n)[1]:
                n_fire += 1
                if st.budget > sel["width"] or st.ring_lo > n - r.cfg.n_d:  # n_d observation rows: ring + current
                    return False
            elif st.topb is not None and st.topb.shape[2] > sel["width"]:
                return False
        if not 0 < n_fire <= sel["f_cap"]:
            return False
        self._pending = (forward_batch, reqs, lens, "select")
        return True

    def _decide(self, forward_batch) -> str | None:
        if self.wants_graph(forward_batch):
            return "sparse"
        if self.wants_select(forward_batch):
            return "select"
        from sglang_sparse.loopserve.runner import STATE_ATTR

        bs = int(forward_batch.batch_size)
        reqs = batch_requests(forward_batch)
        lens = forward_batch.seq_lens_cpu
        if not forward_batch.forward_mode.is_decode() or bs == 0 or reqs is None or len(reqs) != bs \
                or lens is None:
            return None
        needs_init = getattr(forward_batch, "needs_forward_metadata_init", None)
        if needs_init is not None and not needs_init():
            return None
        for req in reqs:
            st = getattr(req, STATE_ATTR, None)
            if st is not None and st.prefill_done:
                return None  # a sparse row that is not steady: eager
        self._pending = (forward_batch, reqs, host_ints(lens, bs), "dense")
        return "dense"

    # ------------------------------------------------------------------ out-of-graph planning
    def plan(self, backend, view, in_capture: bool) -> None:
        """Plan a captured (``in_capture``) or replayed decode batch ``view`` (SGLang's padded replay view)."""
        bs = int(view.batch_size)
        if in_capture:
            self._capture(backend, view, bs)
            return
        pending, self._pending = self._pending, None
        d = (self._select if pending is not None and pending[3] == "select" else self._dicts).get(bs)
        if pending is None or (d is None and pending[3] != "dense"):
            raise RuntimeError(f"sglang-sparse loopserve: a decode graph of batch size {bs} is replayed without "
                               "a batch planned by wants_graph (can_run_graph hook not applied?)")
        fb, reqs, lens, variant = pending
        raw = len(lens)
        view_lens = view.seq_lens_cpu
        if raw > bs or (view_lens is not None and host_ints(view_lens, raw) != lens):
            raise RuntimeError("sglang-sparse loopserve: the replayed batch is not the one can_run_graph saw")
        r = self.runner
        if variant == "dense":  # the stock graph: the eager planning of a batch without sparse rows (statistics)
            r.begin_batch(backend, fb)
            if r.dec is not None:
                raise RuntimeError("sglang-sparse loopserve: a stock-graph step planned a sparse row")
            self.dense_replays += 1
            if self.stats is not None:
                self.stats.dense_graph_steps += 1
            return
        if variant == "select":
            self._plan_select(backend, d, fb, reqs, raw, bs)
            return
        r.planning_for_graph = True
        r.steady_into = (self.lists_buf, self.lens_buf) if r.steady_into_static else None
        try:
            r.begin_batch(backend, fb)  # the eager planning: ring commit, lists of every layer, statistics
        finally:
            r.planning_for_graph, r.steady_into = False, None
        e = r.dec
        if e is None or "lists_all" not in e or e["sel"] is not None or len(e["rows"]) != raw:
            raise RuntimeError("sglang-sparse loopserve: a graph step planned as a non-steady step")
        lists, lens_all = e["lists_all"]
        if lists.data_ptr() != self.lists_buf.data_ptr():  # built elsewhere (the sort-based path): copied in
            w = min(lists.shape[3], self.width, max(lens))  # entries past a list's length (<= its context): padding
            self.lists_buf[:, :raw, :, :w].copy_(lists[..., :w])
            self.lens_buf[:, :raw].copy_(lens_all)
        self.lens_buf[:, raw:bs].zero_()
        self._bind(e, d, _STATIC_KEYS, reqs, raw, bs)

    def _bind(self, e, d, keys, reqs, raw: int, bs: int) -> None:
        """A replayed step's runner dict: the eager plan ``e``'s per-row facts (statistics, rows) with the static
        tensors ``keys`` of the captured dict ``d``; the step's lengths, queries and working set in the graph's
        fixed buffers."""
        r = self.runner
        d["vs"].seq_lens[:raw].copy_(e["seq32"])
        if r._pending_ring is not None:  # this step's queries land in the static buffer: commit from there
            # (planning_for_graph left the eager plan without a query buffer of its own)
            r._pending_ring = (self.q_buf[:, :raw], r._pending_ring[1])
        r.dec = {**e, **{k: d[k] for k in keys}}
        r.dec["vs"] = dataclasses.replace(d["vs"], max_len=e["max_len"])  # the reference path's mask width
        if r.ws is not None:  # the graph records into the tracker's fixed buffers: plan them (padding rows -> trash)
            r.ws.plan([getattr(q, "rid", None) for q in reqs], pad_to=bs)
        self.replays += 1
        if self.stats is not None:
            self.stats.graph_decode_steps += 1

    def _plan_select(self, backend, d, fb, reqs, raw: int, bs: int) -> None:
        """A re-selecting step replayed from the graph of batch size ``bs``: the eager planning written into the
        captured buffers (selection inputs, every layer's lists before the new top-B, statistics)."""
        r = self.runner
        r.planning_for_graph, r.select_into = True, d
        try:
            r.begin_batch(backend, fb)
        finally:
            r.planning_for_graph, r.select_into = False, None
        e = r.dec
        if e is None or e["sel"] is None or "lists_all" in e or len(e["rows"]) != raw:
            raise RuntimeError("sglang-sparse loopserve: a re-selecting graph step planned as another kind of step")
        if "sel_lists" not in e:
            raise RuntimeError("sglang-sparse loopserve: a re-selecting graph step planned without its lists")
        # padding rows read nothing: empty lists, no tail (since past any length), top-B -1
        self.lens_buf[:, raw:bs].zero_()
        self.marks_buf[:, raw:bs].zero_()
        self.since_buf[:raw].copy_(e["since"])
        self.since_buf[raw:bs].fill_(1 << 30)
        d["step_rows"][:raw].copy_(r.step_rows[:raw])  # the graph adds each layer's tokens read to these rows
        d["step_rows"][raw:bs].zero_()
        r.step_rows = d["step_rows"]
        self._bind(e, d, _SELECT_STATIC_KEYS, reqs, raw, bs)
        self.select_replays += 1
        if self.stats is not None:
            self.stats.graph_select_steps += 1

    def _capture(self, backend, view, bs: int) -> None:
        r, sh = self.runner, self.runner.shape
        from sglang_sparse.graph_variants import capture_variant

        variant = capture_variant()
        if bs > self.bs_cap or variant == "dense" or (variant == "select" and not self.select_rows):
            # the stock decode is recorded: SGLang's stock variant, or a size wants_graph never picks (> max_bs)
            r._commit_ring()
            r.ext_rows, r.dec, r.bs, r.is_decode, r.step_rows, r.dense_rows = [], None, bs, True, None, None
            return
        if self.max_bs == 0:  # SGLang captures the largest batch size first: size the buffers by it
            self._allocate(backend, bs)
        if bs > self.max_bs:
            raise RuntimeError(f"sglang-sparse loopserve: decode graph of batch size {bs} captured after the "
                               f"buffers were sized for {self.max_bs}")
        self.lens_buf[:, :bs].zero_()
        # the graph's decode plan: fixed buffers (lengths 1 at capture), split as if self.width wide
        vs = self.vsd.plan(view.req_pool_indices[:bs], self._ones[:bs], max_len=1, list_width=self.width,
                           target_programs=r.target_programs)
        d = dict(rows=list(range(bs)), rows_dev=torch.arange(bs, device=r.device), states=[], fire=[False] * bs,
                 sel=None, all_rows=True,
                 lists_all=(self.lists_buf[:, :bs], self.lens_buf[:, :bs]),
                 q_buf=None if r.lastwindow else self.q_buf[:, :bs], rpi=vs.req_pool_indices,
                 seq32=vs.seq_lens, vs=vs, split=vs.split)
        step_rows = torch.zeros(bs, STEP_COLS, dtype=torch.float32, device=r.device)
        if variant == "select":  # a re-selecting step: the selection's and the lists' static buffers too
            from sglang_sparse.loopserve.select import selection_buffers

            del d["lists_all"]
            d["fire"] = [True] * bs
            d.update(sel=selection_buffers(r, min(bs, self.select_rows), self.width, self.topb_buf.shape[3],
                                           trash_row=self.max_bs, dtype=self.q_buf.dtype),
                     topb_rows=self.topb_buf, topb=self.topb_buf[:bs],
                     # every layer's lists in the steady lists' buffers (the two variants never run at once)
                     sel_lists=(self.lists_buf[:, :bs], self.lens_buf[:, :bs], self.marks_buf[:, :bs]),
                     since=self.since_buf[:bs], step_rows=step_rows)
            self.marks_buf[:, :bs].zero_()
            self.since_buf[:bs].fill_(1 << 30)
            self.topb_buf.fill_(-1)
            self._select[bs] = d
        else:
            self._dicts[bs] = d
        r._commit_ring()
        r.ext_rows, r.dec, r.bs, r.is_decode = [], d, bs, True
        if r.ws is not None:  # the captured forward records into the tracker's trash row
            r.ws.plan([None] * bs, pad_to=bs)
        r.step_rows, r.dense_rows = step_rows, None

    def _allocate(self, backend, max_bs: int) -> None:
        r, sh, dev = self.runner, self.runner.shape, self.runner.device
        self.max_bs = max_bs
        i32 = dict(dtype=torch.int32, device=dev)
        self.lists_buf = torch.zeros(sh.num_layers, max_bs, sh.num_kv_heads, self.width, **i32)
        self.lens_buf = torch.zeros(sh.num_layers, max_bs, sh.num_kv_heads, **i32)
        self._ones = torch.ones(max_bs, **i32)
        kv_dtype = backend.token_to_kv_pool.get_key_buffer(0).dtype
        self.q_buf = None if r.lastwindow else torch.zeros(sh.num_layers, max_bs, sh.num_qo_heads, sh.head_dim,
                                                            dtype=kv_dtype, device=dev)
        if self.select_rows:  # re-selecting steps: the new top-B (one trash row), list marks, since
            topb_w = min(r.cfg.budget, self.width)
            self.topb_buf = torch.full((max_bs + 1, sh.num_layers, sh.num_kv_heads, topb_w), -1, **i32)
            self.marks_buf = torch.zeros(sh.num_layers, max_bs, sh.num_kv_heads, 2, **i32)
            self.since_buf = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        # the decode wrapper's fixed buffers (lengths, side outputs, split partials) for every captured size
        self.vsd = VerticalSlashDecode(sh.num_qo_heads, sh.num_kv_heads, sh.head_dim, dev, use_kernels=r.use_kernels,
                                       list_width=self.width, max_batch=max_bs, target_programs=r.target_programs,
                                       batch_invariant=r.vsd.batch_invariant)
        nbytes = sum(t.numel() * t.element_size() for t in (self.lists_buf, self.lens_buf, self.vsd._partial_o_buf,
                                                             self.vsd._partial_lse_buf)
                     + ((self.q_buf,) if self.q_buf is not None else ())
                     + ((self.topb_buf, self.marks_buf) if self.select_rows else ()))
        logger.info("sglang-sparse %s: decode graph buffers for batch <= %d, list width %d: %.1f MiB",
                    r.cfg.mode, max_bs, self.width, nbytes / 2**20)


# what a replayed step takes from the captured dict: the tensors (and the split plan) the graph recorded
_STATIC_KEYS = ("lists_all", "q_buf", "rpi", "seq32", "vs", "split", "all_rows")
# ... and a replayed re-selecting step: the selection, top-B and list buffers, the rows and statistics rows
_SELECT_STATIC_KEYS = ("sel", "topb", "topb_rows", "sel_lists", "since", "q_buf", "rpi", "seq32", "vs", "split",
                       "all_rows", "rows_dev")
