"""The LoopServe prefill and decode paths (LoopServe Alg. 2 and 3) behind :mod:`sglang_sparse.loopserve.backend`.

One runner per attention backend. Two compute paths with the same planning:
  * kernels (CUDA, or a CPU server with config ``runner: "kernel"`` + ``TRITON_INTERPRET=1``):
    :func:`flashinfer_ext.loopserve.vs_estimate.vs_estimate`, :func:`flashinfer_ext.loopserve.vs_prefill.vs_prefill`,
    :func:`flashinfer_ext.loopserve.vs_estimate_batched.vertical_sums_batched` and
    :func:`flashinfer_ext.common.sparse_decode.sparse_decode` (``block_size=1``, ``epsilon=1.0``);
  * references (CPU default): the fp32 torch references of :mod:`flashinfer_ext.loopserve.reference`
    (and :func:`~flashinfer_ext.loopserve.vs_estimate_batched.vertical_sums_batched_reference`) and a masked fp32
    decode. A correctness path; no speed claim.
Selection (:func:`flashinfer_ext.loopserve.vs_select.vs_select`,
:func:`~flashinfer_ext.loopserve.vs_estimate_batched.decode_topb_batched`) is pure torch and shared by both.

Per request, state lives on SGLang's ``Req`` object (``req.sparse_loopserve``, freed with it):
the union of its line sets per layer and KV head (the earlier turns' lines found on the radix path
+ every prefill chunk's selection; bool masks during prefill, compacted index lists after), the
last ``n_d`` queries per layer (a ring indexed by ``position % n_d``), the current top-B per layer
and KV head, and the position from which generated tokens are always attended.

Where the host work goes (nothing per layer needs a sync; no ``.item()``):
  * :meth:`begin_batch` (once per batch, SGLang's ``init_forward_metadata``): commits the previous
    decode step's queries to the rings and its re-selected top-B to the request states (one copy per
    row each, all layers), reads the host lengths, each request's options (``custom_params``), decides
    per row dense / sparse and whether Alg. 3 re-selects at this step, samples the estimation rows,
    looks earlier turns' lines up in the line store, compacts the line masks of requests whose prefill
    just finished (one device->host read of their counts), and pads the per-row line lists of a decode
    batch into batch tensors (small host->device copies). For the re-selecting rows of a decode step it
    also plans the batched selection (:func:`sglang_sparse.loopserve.select.plan_selection`): one gather per row of its earlier
    observation queries from its ring for all layers, and the rows' positions, request indices, pool
    rows, scored lengths and budgets in one host->device copy.
  * per layer, extend: with ``prefill: "lines"`` estimation + selection + sparse prefill per sparse extend row (one
    request per kernel call: the kernels are single-request); with ``prefill: "dense"`` one gather of the sampled
    query rows, the lines of every layer then selected after the forward in one batched selection
    (:mod:`sglang_sparse.loopserve.prefill_lines`, from :meth:`finish_extend`). Device work only (the selection's
    split sizes are built without ``unique`` so that it never syncs).
  * per layer, decode: one copy of all sparse rows' queries into the step's query buffer (committed to the
    per-request rings at the next :meth:`begin_batch`); at re-selection steps, for ALL re-selecting rows at once,
    :func:`~flashinfer_ext.loopserve.vs_estimate_batched.vertical_sums_batched` and
    :func:`~flashinfer_ext.loopserve.vs_estimate_batched.decode_topb_batched` (mask + topk), then this layer's
    token lists for all sparse rows (:mod:`sglang_sparse.loopserve.lists`: on the kernel path every layer's
    lines ∪ sink ∪ slash keys ∪ tail in one launch per step, to which each re-selecting layer appends its new
    top-B; at steps without re-selection the lists come from the requests' sorted bases, no sort), then one
    split-list decode over all rows and KV heads (:func:`flashinfer_ext.common.split_decode.sparse_decode_split`)
    through :class:`flashinfer_ext.loopserve.decode.VerticalSlashDecode` (planned once per step). The lists are
    cut as if ``graph_list_width`` wide, so eager and graph-replayed steps give the same outputs. Statistics are
    in-place adds into the device step rows; the planning copies are pinned and non-blocking.
  * steady decode steps (no row selects top-B) replay SGLang's decode CUDA graph over static buffers
    planned by :mod:`sglang_sparse.loopserve.graph` (it calls :meth:`begin_batch` outside the graph).
  * re-selecting decode steps replay the re-selecting graph variant when they fit it (``select_graph_rows``).
The prefill side stays per request: with ``prefill: "lines"`` estimation + :func:`vs_select` and the sparse prefill in
each layer; with ``prefill: "dense"`` (default) the stock attention computes the rows and the lines are selected
after the forward for all layers at once (``line_chunks``: in which chunks). When every row of a decode batch (or, with ``"lines"``, of an
extend batch) is sparse the backend skips the stock attention (K/V written as stock writes them); in a mixed
batch the stock backend computes all rows first and the sparse rows are then overwritten. A mixed batch
(``--enable-mixed-chunk``) treats its decode rows as 1-token extend rows.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch

from flashinfer_ext.loopserve.decode import VerticalSlashDecode
from flashinfer_ext.loopserve.vs_estimate import sample_query_rows, target_programs_of
from flashinfer_ext.loopserve.vs_select import VSSelectConfig, VSSelectPlan, _compact, vs_select, vs_select_plan
from sglang_sparse.config import LoopServeConfig
from sglang_sparse.loopserve.lists import (LISTS_ALL_MAX_ENTRIES, BaseRows, merge_all_layers, plan_union_append,
                                           plan_select_lists, select_bases, select_lists,
                                           static_all_layers, steady_lists, steady_width, union_lists)
from sglang_sparse.loopserve.prefill_lines import apply_lines, record_queries, select_all_layers
from sglang_sparse.loopserve.select import SELECT_SPLIT_KEYS, h2d as _h2d, plan_selection, reselect
from sglang_sparse.loopserve.stats import (
    COL_ALPHA, COL_COV, COL_KIND, COL_LTOT, COL_READ, COL_RESEL, COL_REUSED, COL_S, COL_TTOT, COL_UNITS, COL_V,
    KIND_DECODE, KIND_DENSE, KIND_LASTWINDOW, KIND_PREFILL, STEP_COLS,
)
from sglang_sparse.request_params import batch_requests, host_ints, request_values
from sglang_sparse.stats import host_row

FIRST_RESELECT = 16  # Alg. 3: the first re-selection at the 16th generated token

STATE_ATTR = "sparse_loopserve"


_OPTIONS_ATTR = "_sparse_loopserve_options"  # on a scheduler ``Req``: its (alpha, budget), read once


def request_options(cfg: LoopServeConfig, req) -> tuple[float, int]:
    """(alpha, budget) of a request (:func:`sglang_sparse.request_params.request_values`: its validated
    ``custom_params.sparse`` values, else the server's). ``lastwindow`` takes no per-request options and has
    no alpha: its prefill is dense, reported as alpha 1.0, and its budget is the server's. Read once per request
    and kept on the ``Req`` (its options never change; every batch of its life asks again)."""
    got = getattr(req, _OPTIONS_ATTR, None) if req is not None else None
    if got is not None:
        return got
    vals = request_values(cfg, req)
    got = float(vals.get("alpha", getattr(cfg, "alpha", 1.0))), int(vals.get("budget", cfg.budget))
    if req is not None:
        setattr(req, _OPTIONS_ATTR, got)
    return got


@dataclasses.dataclass
class ReqState:
    """LoopServe state of one request (see the module docstring)."""

    alpha: float
    budget: int
    turn_start: int                 # first position this request prefilled
    prompt_len: int                 # positions of the prompt (prefill ends here)
    vmask: torch.Tensor | None      # [L, Hk, prompt_len + 1] bool during prefill (last column: padding sink)
    smask: torch.Tensor | None
    acc: torch.Tensor               # [STEP_COLS] fp32 cumulative prefill statistics
    ring: torch.Tensor              # [L, R, Hq, D] last queries by position % R (R = n_d; lastwindow: window)
    ring_lo: int = 1 << 62          # lowest position whose query is in the ring
    prefill_done: bool = False
    lines: tuple | None = None      # (v_idx [L,Hk,Wv], v_cnt [L,Hk], s_idx [L,Hk,Ws], s_cnt) after prefill
    topb: torch.Tensor | None = None  # [L, Hk, B] int32 positions (-1 padded) after the first re-selection
    since: int = 0                  # positions >= since are always attended (tokens generated since)
    attached: bool = False          # lines stored on a radix node
    uid: int = 0                    # unique within the runner (loopserve.lists.BaseRows keys)
    base: tuple | None = None       # (base [L, Hk, Wa], lens [L, Hk]): lines U top-B U sink, sorted (steady steps)
    base_version: int = 0           # bumped when top-B changes (the base is then rebuilt)
    base0: tuple | None = None      # (base0 [L, Hk, Wa], lens [L, Hk]): lines U sink, sorted (re-selecting steps)

    def finalize(self) -> None:
        """Compact the prefill masks into index lists (one host read of the counts)."""
        if self.lines is not None or self.vmask is None:
            return
        n = self.vmask.shape[2] - 1
        v_idx, v_cnt = _compact_3d(self.vmask[:, :, :n])
        s_idx, s_cnt = _compact_3d(self.smask[:, :, :n])
        self.lines = (v_idx, v_cnt, s_idx, s_cnt)
        self.vmask = self.smask = None


def _compact_3d(mask: torch.Tensor):
    """bool ``[L, H, n]`` -> ascending int32 indices ``[L, H, W]`` (-1 padded, W = max count) and counts."""
    n = mask.shape[2]
    cnt = mask.sum(2, dtype=torch.int32)
    w = int(cnt.max()) if cnt.numel() else 0
    ar = torch.arange(n, device=mask.device, dtype=torch.int32)
    idx = torch.where(mask, ar, n).sort(dim=2).values[:, :, :w]
    return torch.where(idx >= n, -1, idx).contiguous(), cnt


def _pad(ts, width: int, sh, dev) -> torch.Tensor:
    """Per-row ``[L, Hk, w]`` int32 tensors (None: none) -> ``[rows, L, Hk, max(width, 1)]``, ``-1`` padded."""
    out = torch.full((len(ts), sh.num_layers, sh.num_kv_heads, max(width, 1)), -1, dtype=torch.int32, device=dev)
    for j, t in enumerate(ts):
        if t is not None and t.shape[2]:
            out[j, :, :, : t.shape[2]] = t
    return out


@dataclasses.dataclass
class _ExtRow:
    row: int
    state: ReqState
    q_lo: int
    prefix: int
    seq: int
    rpi: int
    sample: torch.Tensor      # [R] int64 local indices of the sampled rows (device)
    last_chunk: bool
    sample_pos: torch.Tensor | None = None  # [R] their positions (sample + prefix), built once per batch
    sel_plan: VSSelectPlan | None = None     # the segment's selection plan (all layers), built once per batch
    layers_done: int = 0                     # layers whose lines were selected (host count, for the statistics)
    q_obs: torch.Tensor | None = None        # [L, R, Hq, D] the sampled rows per layer (dense prefill: deferred lines)
    scale: float = 0.0                       # the layers' softmax scale (deferred lines)


def _decoding_sparsely(req) -> bool:
    """Whether a decode row's request decodes through LoopServe (its sparse prefill is done)."""
    st = getattr(req, STATE_ATTR, None)
    return st is not None and st.prefill_done


class LoopServeRunner:
    def __init__(self, cfg: LoopServeConfig, shape, device: torch.device, *, use_kernels: bool, store=None,
                 max_context: int | None = None, batch_invariant: bool = False):
        """``max_context``: the served context length (a token list is never wider: it caps the split width).
        ``batch_invariant`` (``--enable-deterministic-inference``): the decode splits every step's lists as for a
        batch of one row (:class:`~flashinfer_ext.loopserve.decode.VerticalSlashDecode`), so a row's output does not
        depend on the rows decoded beside it."""
        self.cfg = cfg
        self.shape = shape
        self.device = device
        self.use_kernels = use_kernels
        self.store = store
        self.bs = 0
        self.is_decode = False
        self.step_rows: torch.Tensor | None = None
        # a batch left to the stock attention (no sparse row): its rows as host tuples instead of ``step_rows``
        self.dense_rows: tuple | None = None
        self.ext_rows: list[_ExtRow] = []
        self.dec: dict | None = None
        self._pending_ring = None   # (q_buf [L, nS, Hq, D], [(state, ring slot)]) of the last decode step
        self._pending_topb = None   # (topb [nS, L, Hk, W], [(state, row, width)]) of the last re-selection step
        self.n_sparse_prefill_rows = 0
        # lastwindow (SnapKV-like baseline): dense prefill that only records the prompt's last `window`
        # queries; one top-B selection at the first decode step; no lines, no re-selection
        self.lastwindow = cfg.mode == "lastwindow"
        # loopserve prefill: Alg. 2's sparse attention over the lines ("lines"), or the stock dense attention with
        # the lines only estimated and selected ("dense"); lastwindow's prefill is always dense
        self.sparse_prefill = not self.lastwindow and getattr(cfg, "prefill", "lines") == "lines"
        self.planning_for_graph = False  # set by loopserve.graph while it plans a replayed step
        self.select_into = None  # loopserve.graph: the captured buffers a replayed re-selecting step is planned into
        # loopserve.graph: the captured (lists [L, max_bs, Hk, W], lens [L, max_bs, Hk]) a replayed steady step's lists
        # are written into (no all-layer temporary, so no LISTS_ALL_MAX_ENTRIES cap on graph-replayed steps)
        self.steady_into = None
        self.ws = None  # loopserve.ws.LoopServeWorkingSet: decode steps record what they read (host tier admission)
        # the span count is planned as if the lists were graph_list_width wide, graphs on or off (each list is cut
        # into those spans by its own length): eager and graph-replayed steps of a batch size (and servers with and
        # without graphs) cut the same lists into the same spans, so their outputs agree bit for bit
        # (loopserve.graph sizes its static lists by it)
        self.split_width = int(getattr(cfg, "graph_list_width", 0))
        if max_context:
            self.split_width = min(self.split_width, int(max_context))
        # split-list decode (flashinfer_ext.common.split_decode): aim at about two waves of programs per layer
        self.target_programs = target_programs_of(device)
        self._acc_cols = torch.tensor([COL_V, COL_S, COL_COV], device=device)  # the per-layer prefill statistics
        # re-selection's LSE pass: key span (fixed, so eager and graph-replayed steps compute the same bits)
        self.lse_split_keys = SELECT_SPLIT_KEYS
        # the decode over the step's token lists: plan() once per step, run() per layer (kernels or reference)
        self.vsd = VerticalSlashDecode(shape.num_qo_heads, shape.num_kv_heads, shape.head_dim, device,
                                       use_kernels=use_kernels, batch_invariant=bool(batch_invariant))
        # steady and (kernel path) re-selecting steps: lists from the requests' sorted bases (loopserve.lists);
        # False: the sort-based builds (bench/loopserve_step_bench.py times both)
        self.steady_from_bases = True
        self._uids = itertools.count(1)  # request-state ids (ReqState.uid)
        self._base_rows = BaseRows()     # a steady step's padded bases / offsets, kept while the batch is unchanged

    # ------------------------------------------------------------------ planning (once per batch)
    def _commit_ring(self) -> None:
        """Write the previous decode step's queries into the rings and its re-selected top-B into the
        request states (one copy per row, all layers, each)."""
        pending, self._pending_ring = self._pending_ring, None
        if pending is not None:
            q_buf, targets = pending
            for j, (st, slot) in enumerate(targets):
                st.ring[:, slot] = q_buf[:, j]
        pending, self._pending_topb = self._pending_topb, None
        if pending is not None:
            topb, targets = pending
            for st, j, w in targets:
                st.topb = topb[j, :, :, :w].clone()
                st.base, st.base_version = None, st.base_version + 1

    def begin_batch(self, backend, forward_batch) -> None:
        self._commit_ring()
        mode = forward_batch.forward_mode
        self.ext_rows, self.dec = [], None
        if self.ws is not None:
            self.ws.reset()
        bs = int(forward_batch.batch_size) if not mode.is_idle() else 0
        self.bs = bs
        self.is_decode = mode.is_decode()
        self.dense_rows = None
        reqs = batch_requests(forward_batch)
        if bs == 0 or reqs is None or len(reqs) != bs:
            self.step_rows = torch.zeros(bs, STEP_COLS, dtype=torch.float32)
            return
        alphas = [request_options(self.cfg, r)[0] for r in reqs]
        if self.is_decode and not any(_decoding_sparsely(r) for r in reqs):
            self._dense_batch(alphas)  # every row on the stock decode: host rows only, no tensor, no copy
            return
        if mode.is_extend():
            self._plan_extend(backend, forward_batch, reqs)
            if not self.ext_rows:
                self._dense_batch(alphas)
                return
        host = torch.zeros(bs, STEP_COLS, dtype=torch.float32)
        host[:, COL_ALPHA] = torch.tensor(alphas)
        if self.is_decode:
            self._plan_decode(backend, forward_batch, reqs, host)
        self.step_rows = _h2d(host, self.device)
        if self.dec is not None and "lists_all" in self.dec:  # tokens read this step, all layers at once
            self.step_rows[self.dec["rows_dev"], COL_READ] += self.dec["lists_all"][1].sum((0, 2), dtype=torch.float32)

    def _dense_batch(self, alphas: list[float]) -> None:
        """Rows of a batch the stock attention runs alone (no sparse row): ``dense_rows``, one host tuple per row
        (kind dense, the request's alpha)."""
        self.step_rows = None
        self.dense_rows = tuple(host_row(STEP_COLS, {COL_KIND: KIND_DENSE, COL_ALPHA: a}) for a in alphas)

    def _new_state(self, req, alpha, budget, prefix, backend) -> ReqState:
        sh, dev = self.shape, self.device
        plen = len(req.origin_input_ids)
        ring_len = self.cfg.window if self.lastwindow else self.cfg.n_d
        st = ReqState(alpha=alpha, budget=budget, turn_start=prefix, prompt_len=plen,
                      vmask=torch.zeros(sh.num_layers, sh.num_kv_heads, plen + 1, dtype=torch.bool, device=dev),
                      smask=torch.zeros(sh.num_layers, sh.num_kv_heads, plen + 1, dtype=torch.bool, device=dev),
                      acc=torch.zeros(STEP_COLS, dtype=torch.float32, device=dev),
                      ring=torch.zeros(sh.num_layers, ring_len, sh.num_qo_heads, sh.head_dim,
                                       dtype=backend.token_to_kv_pool.get_key_buffer(0).dtype, device=dev))
        st.uid = next(self._uids)
        st.acc[COL_KIND] = KIND_DENSE if self.lastwindow else KIND_PREFILL
        st.acc[COL_ALPHA] = alpha
        if self.store is not None and prefix > 0:
            reused = self.store.lookup(req, prefix)
            if reused is not None:
                v_idx, v_cnt, s_idx, s_cnt = (t.to(dev) for t in reused)
                for idx, cnt, mask, lim in ((v_idx, v_cnt, st.vmask, prefix), (s_idx, s_cnt, st.smask, plen)):
                    ok = (torch.arange(idx.shape[2], device=dev)[None, None, :] < cnt[:, :, None].long()) \
                        & (idx >= 0) & (idx < lim)
                    mask.scatter_(2, torch.where(ok, idx.long(), plen), True)
                    st.acc[COL_REUSED] += ok.sum()
        return st

    def _plan_extend(self, backend, fb, reqs) -> None:
        cfg = self.cfg
        prefix = [int(x) for x in fb.extend_prefix_lens_cpu] if fb.extend_prefix_lens_cpu is not None \
            else [0] * self.bs
        ext = [int(x) for x in fb.extend_seq_lens_cpu]
        q_lo = 0
        sel_base = None if self.lastwindow else \
            VSSelectConfig(alpha=1.0, sink_tokens=cfg.sink_tokens, local_window=cfg.local_window)
        for i, req in enumerate(reqs):
            p, e = prefix[i], ext[i]
            seq = p + e
            st = getattr(req, STATE_ATTR, None)
            alpha, budget = request_options(cfg, req)
            if e > 0 and seq >= cfg.min_context and (alpha < 1.0 or self.lastwindow) \
                    and seq <= len(req.origin_input_ids):
                if st is None or st.prefill_done:
                    st = self._new_state(req, alpha, budget, p, backend)
                    setattr(req, STATE_ATTR, st)
                last = seq >= len(req.origin_input_ids)
                selects = sel_base is not None and self._chunk_selects(last)
                if last and sel_base is not None and cfg.line_chunks == "none":  # the always-attended lines only
                    st.vmask[:, :, : min(cfg.sink_tokens, seq)] = True
                    st.smask[:, :, : min(cfg.local_window, seq)] = True
                sample = sample_query_rows(e, cfg.sampled_rows) if selects else torch.zeros(0, dtype=torch.long)
                self.ext_rows.append(_ExtRow(i, st, q_lo, p, seq, int(fb.req_pool_indices_cpu[i])
                                             if getattr(fb, "req_pool_indices_cpu", None) is not None
                                             else int(req.req_pool_idx), _h2d(sample, self.device), last,
                                             sample_pos=_h2d(sample + p, self.device),
                                             sel_plan=vs_select_plan(
                                                 seq, p, dataclasses.replace(sel_base, alpha=st.alpha), self.device)
                                             if selects else None))
            q_lo += e

    def _chunk_selects(self, last_chunk: bool) -> bool:
        """Whether an engaged prefill chunk estimates and selects lines (``line_chunks``; a sparse prefill always)."""
        which = self.cfg.line_chunks  # auto: last (a sparse prefill always selects)
        return self.sparse_prefill or which == "all" or (which in ("last", "auto") and last_chunk)

    def row_fires(self, st: ReqState, seq_len: int) -> tuple[bool, bool]:
        """``(re-selects by Alg. 3, selects top-B at this step)`` of a decode row whose prefill is done, at
        context length ``seq_len`` (host ints only)."""
        n_o = seq_len - st.prompt_len  # tokens generated so far (the first one came from prefill)
        if self.lastwindow:  # one selection, at the first decode step, from the prompt's last window
            return False, n_o == 1
        f = n_o >= FIRST_RESELECT and (n_o - FIRST_RESELECT) % self.cfg.n_d == 0
        # initial_topb: until Alg. 3's first re-selection (token 16) every decode step selects top-B too,
        # observing the last n_d queries (the prompt's last ones, then the generated ones): the stored
        # prefill lines alone lost a planted fact on SmolLM2 (CPU reference and H100 alike), and one
        # selection from the prompt's last queries alone still lost it at budget 128 (CPU reference)
        return f, f or (n_o < FIRST_RESELECT and self.cfg.initial_topb)

    def _plan_decode(self, backend, fb, reqs, host) -> None:
        cfg, sh = self.cfg, self.shape
        lens = host_ints(fb.seq_lens_cpu)
        rows, fire, resel = [], [], []
        for i, req in enumerate(reqs):
            st = getattr(req, STATE_ATTR, None)
            if st is None or not st.prefill_done:
                continue
            st.finalize()
            if st.since == 0:
                st.since = st.prompt_len
            r, f = self.row_fires(st, lens[i])
            rows.append(i)
            resel.append(r)
            fire.append(f)
        if not rows:
            return
        dev = self.device
        states = [getattr(reqs[i], STATE_ATTR) for i in rows]
        n_s = len(rows)
        # a steady step (no row selects top-B): every layer's lists from the requests' sorted bases + slash keys +
        # tail in one launch (loopserve.lists.steady_lists), the padded inputs kept while the batch is unchanged
        steady_w = None
        selecting = any(fire)
        static = self.select_into if selecting else None  # a re-selecting step replayed from a graph
        # a re-selecting step on the kernel path: every layer's lists from the rows' bases (a re-selecting row's
        # without its old top-B) + slash keys + tail in one launch here, then each layer appends its new top-B
        # (loopserve.lists.plan_select_lists / select_lists)
        sel_from_bases = selecting and self.use_kernels and self.steady_from_bases and not self.lastwindow
        if not selecting and self.steady_from_bases and self.use_kernels:  # (Triton: the kernel path only)
            max_since = max(lens[i] - st.since for st, i in zip(states, rows))
            steady_w = steady_width(self._base_rows, states, cfg.sink_tokens, max_since)
            if self.steady_into is None and not self.lists_all_fits(n_s, steady_w):
                steady_w = None
        v = s_ = tb = sel_bases = None
        if steady_w is None:
            bwidth = 0
            for st, i, f in zip(states, rows, fire):
                w = min(st.budget, lens[i]) if f else (0 if st.topb is None or sel_from_bases else st.topb.shape[2])
                bwidth = max(bwidth, w)
            if sel_from_bases:  # the bases before `since` moves; every row's top-B slot -1 (the old ones are in bases)
                sel_bases = select_bases(states, fire, cfg.sink_tokens)
                tb = static["topb"] if static is not None else \
                    torch.full((n_s, sh.num_layers, sh.num_kv_heads, max(bwidth, 1)), -1, dtype=torch.int32, device=dev)
                if static is not None:
                    static["topb_rows"].fill_(-1)
            else:
                v = _pad([s.lines[0] for s in states], max(s.lines[0].shape[2] for s in states), sh, dev)
                s_ = _pad([s.lines[2] for s in states], max(s.lines[2].shape[2] for s in states), sh, dev)
                # a re-selecting row's top-B is rewritten at every layer of this step: start it from -1, not its old one
                tb = _pad([None if f else s.topb for s, f in zip(states, fire)], bwidth, sh, dev)
            for st, i, f in zip(states, rows, fire):
                if f:  # lastwindow keeps its observation window too
                    st.since = max(st.prompt_len - self.cfg.window, 0) if self.lastwindow else lens[i] - 1
        rows_t = torch.tensor(rows)
        seq_host = [lens[i] for i in rows]
        # every per-row int of the step in one pinned, non-blocking host->device copy (a pageable copy
        # blocks the host until the GPU has caught up: one stream sync per copy)
        packed = _h2d(torch.tensor(rows + seq_host + [st.since for st in states], dtype=torch.int64), dev)
        rows_dev, seq_dev, since_dev = packed.split(n_s)
        # the step's queries (committed to the rings at the next batch); a graph-replayed step writes them into
        # the graph's static buffer instead (loopserve.graph puts it in _pending_ring)
        q_buf = None if self.lastwindow or self.planning_for_graph else torch.empty(
            sh.num_layers, len(rows), sh.num_qo_heads, sh.head_dim, dtype=states[0].ring.dtype, device=dev)
        self._pending_ring = None if self.lastwindow else \
            (q_buf, [(st, (lens[i] - 1) % cfg.n_d) for st, i in zip(states, rows)])
        all_rows = n_s == self.bs
        rpi = fb.req_pool_indices if all_rows else fb.req_pool_indices[rows_dev.to(fb.req_pool_indices.device)]
        max_since = max(lens[i] - st.since for st, i in zip(states, rows))
        if steady_w is not None:
            width = steady_w
        elif sel_bases is not None:
            width = sel_bases[0].shape[3] + sel_bases[2].shape[3] + tb.shape[3] + max_since  # plan_select_lists' W
        else:
            width = v.shape[3] + s_.shape[3] + tb.shape[3] + cfg.sink_tokens + max_since
        # the decode wrapper's plan: lengths into its buffers, split plan + partials shared by every layer (a step
        # planned for a graph replay takes the captured plan instead)
        vs = self.vsd.plan(rpi, seq_dev, max_len=max(seq_host), list_width=max(width, self.split_width),
                           target_programs=self.target_programs, split=not self.planning_for_graph)
        self.dec = dict(rows=rows, rows_dev=rows_dev, states=states, fire=fire, v=v, s=s_, topb=tb,
                        q_buf=q_buf, seq=seq_dev, pos=seq_dev - 1, max_len=max(seq_host),
                        since=since_dev, rpi=rpi, max_since=max_since, all_rows=all_rows, vs=vs, seq32=vs.seq_lens,
                        sel=plan_selection(self, states, [lens[i] for i in rows], fire, rpi,
                                           into=None if static is None else static["sel"]))
        if vs.split is not None:
            self.dec["split"] = vs.split
        if steady_w is not None:
            into = None if self.steady_into is None else tuple(t[:, :n_s] for t in self.steady_into)
            self.dec["lists_all"] = steady_lists(self._base_rows, states, since_dev, seq_dev,
                                                 sink_tokens=cfg.sink_tokens, max_since=max_since, out=into)
        elif sel_bases is not None:  # every layer's lists but the new top-B, in one launch (each layer appends its own)
            plan_select_lists(self.dec, sel_bases, out=None if static is None else static["sel_lists"])
        elif self.lists_all_fits(len(rows), width):
            # every layer's top-B-independent candidates at once, here; no row re-selects at this step: every
            # layer's sets too (else merged with each layer's new top-B in decode; over the cap: all per layer)
            self.dec["static_all"] = static_all_layers(self.dec, cfg.sink_tokens)
            if self.dec["sel"] is None:
                self.dec["lists_all"] = merge_all_layers(self.dec)
            elif self.use_kernels:  # sorted + deduplicated once here; each layer appends its top-B (one launch)
                plan_union_append(self.dec)
        if self.dec["sel"] is not None:  # the new top-B back into the request states at the next begin_batch
            self._pending_topb = (tb, [(states[j], j, w) for j, w in self.dec["sel"]["widths"]])
        units = sh.num_layers * sh.num_kv_heads
        host[rows_t, COL_KIND] = float(KIND_LASTWINDOW if self.lastwindow else KIND_DECODE)
        host[rows_t, COL_TTOT] = torch.tensor(seq_host, dtype=torch.float32) * units
        host[rows_t, COL_RESEL] = torch.tensor(resel, dtype=torch.float32)
        if self.ws is not None and not self.planning_for_graph:  # a replayed step: loopserve.graph plans it
            self.ws.plan([getattr(reqs[i], "rid", None) for i in rows])

    def lists_all_fits(self, n_rows: int, width: int) -> bool:
        """Whether a decode step of ``n_rows`` sparse rows with lists ``width`` wide (before deduplication) plans
        every layer's lists at once in :meth:`begin_batch` (else each layer builds its own)."""
        return self.shape.num_layers * n_rows * self.shape.num_kv_heads * width <= LISTS_ALL_MAX_ENTRIES

    @property
    def steady_into_static(self) -> bool:
        """Whether a steady step planned for a graph replay writes every layer's lists straight into the graph's
        static buffers (:attr:`steady_into`; the kernel path's :func:`~sglang_sparse.loopserve.lists.steady_lists`):
        then its width is bounded by the graph's, not by :meth:`lists_all_fits`."""
        return self.steady_from_bases and self.use_kernels

    # ------------------------------------------------------------------ per layer
    @property
    def any_sparse(self) -> bool:
        return bool(self.ext_rows) or self.dec is not None

    @property
    def all_rows_sparse(self) -> bool:
        """Every row of this batch takes the sparse path (the backend may then skip the stock compute)."""
        if self.bs == 0 or (self.dec is None and not self.sparse_prefill):  # a dense prefill: the stock compute
            return False
        if self.dec is not None:
            return len(self.dec["rows"]) == self.bs
        return len(self.ext_rows) == self.bs

    def extend(self, backend, o3, q3, layer) -> None:
        """Overwrite the sparse rows of ``o3 [T, Hq, D]`` with their vertical/slash sparse prefill."""
        cfg = self.cfg
        lid = layer.layer_id
        pool = backend.token_to_kv_pool
        k_buf, v_buf = pool.get_key_buffer(lid), pool.get_value_buffer(lid)
        rtt = backend.req_to_token_pool.req_to_token
        hk = k_buf.shape[1]
        for r in self.ext_rows:
            st = r.state
            q_seg = q3[r.q_lo: r.q_lo + r.seq - r.prefix]
            if r.sel_plan is not None and self.sparse_prefill:  # Alg. 2: this layer's lines, then its sparse rows
                slots = rtt[r.rpi]
                sel = vs_select(self._estimate(q_seg[r.sample], r.sample_pos, k_buf, slots, r.seq, layer.scaling),
                                plan=r.sel_plan)
                # this layer's lines into the masks, its counts and covered bound into the statistics (the
                # host-known columns are added once per batch in finish_extend)
                apply_lines(st, sel, lid, lid + 1, self._acc_cols)
                self._prefill_lines(st, r, sel, lid, hk, q_seg, o3, k_buf, v_buf, slots, layer.scaling)
                r.layers_done += 1
            elif r.sel_plan is not None:  # prefill "dense": the stock rows stay; lines selected after the forward
                record_queries(r, lid, q_seg, layer.scaling, self.shape.num_layers)
            if r.last_chunk:  # the prompt's last queries seed Alg. 3's observation window
                self._record_ring(st, lid, q_seg, r)

    def _prefill_lines(self, st, r, sel, lid, hk, q_seg, o3, k_buf, v_buf, slots, scale) -> None:
        """Alg. 2's sparse attention of row ``r``'s segment into its rows of ``o3``. Lines used: this chunk's
        selection U earlier chunks U earlier turns (reused); a first segment (prefix 0: no earlier chunk, no reused
        turn) uses its selection as it is."""
        if r.prefix == 0:
            v_idx, v_cnt, s_idx, s_cnt = sel.v_idx, sel.v_cnt, sel.s_idx, sel.s_cnt
        else:  # both masks compacted in one pass: [2 * Hk, seq] (verticals first)
            both_idx, both_cnt = _compact(torch.cat([st.vmask[lid, :, : r.seq], st.smask[lid, :, : r.seq]]))
            v_idx, s_idx = both_idx[:hk], both_idx[hk:]
            v_cnt, s_cnt = both_cnt[:hk], both_cnt[hk:]
        o_rows = o3[r.q_lo: r.q_lo + r.seq - r.prefix]
        o_seg = self._prefill(q_seg, k_buf, v_buf, slots, r.prefix, r.seq, v_idx, v_cnt, s_idx, s_cnt, scale,
                              out=o_rows)
        if o_seg is not o_rows:
            o_rows.copy_(o_seg)

    @staticmethod
    def _record_ring(st, lid, q_seg, r) -> None:
        """The segment's last ``R`` queries into the ring (a last chunk shorter than ``R`` records fewer)."""
        n_ring = st.ring.shape[1]
        t = r.seq - r.prefix
        k = min(n_ring, t)
        ring_pos = torch.arange(r.seq - k, r.seq, device=q_seg.device)
        st.ring[lid, ring_pos % n_ring] = q_seg[t - k:].to(st.ring.dtype)

    def finish_extend(self, backend) -> None:
        """After the forward: the dense prefill's deferred line selection (device work over every layer's keys in
        ``backend``'s pool, no sync), then host bookkeeping: mark finished prefills, publish cumulative rows."""
        hk = self.shape.num_kv_heads
        for r in self.ext_rows:
            if r.q_obs is not None:  # prefill "dense": every layer's lines in one batched selection
                select_all_layers(r, self._estimate, backend.token_to_kv_pool,
                                  backend.req_to_token_pool.req_to_token[r.rpi], self._acc_cols)
            if r.layers_done:  # the host-known columns of the layers that ran (one add per row and batch)
                add = host_row(STEP_COLS, {COL_LTOT: 2.0 * r.seq * hk * r.layers_done, COL_UNITS: hk * r.layers_done})
                r.state.acc.add_(_h2d(torch.tensor(add, dtype=torch.float32), self.device))
            self.step_rows[r.row] = r.state.acc
            if r.last_chunk:
                r.state.prefill_done = True
                r.state.ring_lo = max(r.seq - min(r.state.ring.shape[1], r.seq - r.prefix), 0)

    def decode(self, backend, o3, q3, layer) -> None:
        """Overwrite the sparse decode rows of ``o3 [bs, Hq, D]`` (the current K/V already written)."""
        d, cfg = self.dec, self.cfg
        lid = layer.layer_id
        pool = backend.token_to_kv_pool
        k_buf, v_buf = pool.get_key_buffer(lid), pool.get_value_buffer(lid)
        rtt = backend.req_to_token_pool.req_to_token
        rows = d["rows_dev"]
        q_s = q3 if d["all_rows"] else q3[rows]  # all rows sparse (the usual case): no gather
        if d["q_buf"] is not None:  # this step's queries, one copy for all rows (rings updated next batch)
            d["q_buf"][lid] = q_s.to(d["q_buf"].dtype)
        if d["sel"] is not None:  # re-selection rows: one batched estimation + one top-B for all of them
            reselect(self, d, d["sel"], q_s, k_buf, rtt, lid, layer.scaling)
        if "lists_all" in d:  # planned for all layers in begin_batch
            lists, lens = d["lists_all"][0][lid], d["lists_all"][1][lid]
        elif "sel_lists" in d:  # a re-selection step: the planned lists + this layer's new top-B, one launch
            lists, lens = select_lists(d, lid)
        elif "static_sorted" in d:  # a re-selection step: this layer's new top-B appended to the planned lists
            from flashinfer_ext.loopserve.list_union import union_append

            lists, lens = union_append(d["static_sorted"][lid], d["static_lens"][lid], d["topb"][:, lid], d["seq32"],
                                       out=d["union_buf"], lens_out=d["union_lens_buf"])
        elif "static_all" in d:  # the same sets on the reference path: merged with this layer's new top-B
            from flashinfer_ext.common.sparse_decode import decode_union_merge

            lists, lens = decode_union_merge(d["static_all"][lid], d["topb"][:, lid], d["seq32"])
        else:  # over the size cap of the all-layer build: this layer's whole build
            lists, lens = union_lists(d, lid, self.cfg.sink_tokens)
        if self.ws is not None:  # the working set: this layer's lists into the tracker (one launch, no sync)
            self.ws.record(lid, lists, lens)
        direct = d["all_rows"] and o3.dtype == q_s.dtype and o3.is_contiguous()
        o_s = self._sparse_decode(q_s, k_buf, v_buf, rtt, d, lists, lens, layer.scaling, out=o3 if direct else None)
        if not direct:
            o3[rows] = o_s.to(o3.dtype)
        if "lists_all" not in d:  # else counted once for all layers in begin_batch
            self.step_rows[rows, COL_READ] += lens.sum(1, dtype=torch.float32)

    # ------------------------------------------------------------------ compute, per path
    def _estimate(self, q_rows, pos, k_buf, slots, seq, scale):
        from flashinfer_ext.loopserve.vs_estimate import VSLineSums, vs_estimate

        if self.use_kernels:
            return vs_estimate(q_rows.contiguous(), pos, k_buf, slots, seq, sm_scale=scale)
        from flashinfer_ext.loopserve.reference import vs_estimate_reference

        v_sum, v_max, s_sum, s_max = vs_estimate_reference(q_rows, pos.cpu(), k_buf, slots, seq, scale)
        return VSLineSums(v_sum, v_max, s_sum, s_max, q_rows.shape[1] // k_buf.shape[1], q_rows.shape[0])

    def _prefill(self, q_seg, k_buf, v_buf, slots, prefix, seq, v_idx, v_cnt, s_idx, s_cnt, scale, out=None):
        if self.use_kernels:
            from flashinfer_ext.loopserve.vs_prefill import vs_prefill

            ok = out is not None and out.dtype == q_seg.dtype and out.is_contiguous()
            o, _ = vs_prefill(q_seg.contiguous(), k_buf, v_buf, slots, prefix_len=prefix, seq_len=seq,
                              v_idx=v_idx, v_cnt=v_cnt, s_idx=s_idx, s_cnt=s_cnt, sm_scale=scale,
                              out=out if ok else None)
            return o
        from flashinfer_ext.loopserve.reference import vs_prefill_reference

        o, _ = vs_prefill_reference(q_seg, k_buf, v_buf, slots, prefix_len=prefix, seq_len=seq, v_idx=v_idx,
                                    v_cnt=v_cnt, s_idx=s_idx, s_cnt=s_cnt, sm_scale=scale)
        return o

    def _sparse_decode(self, q, k_buf, v_buf, rtt, d, lists, lens, scale, out=None):
        """Decode of rows ``q [nS, Hq, D]`` over the per-(row, KV head) token lists ``lists [nS, Hk, W]``
        (first ``lens [nS, Hk]`` entries) through the step's plan (:class:`VerticalSlashDecode`: kernels, no host
        sync; the reference path attends the same sets as a mask in fp32)."""
        return self.vsd.run(d["vs"], q, k_buf, v_buf, rtt, lists, lens, scale, out=out)
