"""The PSA decode path per device, behind one small interface used by :mod:`sglang_sparse.psa.backend`.

* :class:`PsaCudaRunner` (GPU): block metadata (min/max/mean per page and KV head, one
  :class:`flashinfer_ext.psa.block_meta.BlockMetaPool` beside the KV pool; the page is the block)
  built at a request's first sparse decode step and folded at each later one, and decode through
  :class:`flashinfer_ext.psa.decode.PsaDecodeWrapper` (Triton criticality, device ranking,
  progressive decode with the stop test on the GPU).
* :class:`PsaCpuRunner` (CPU): the fp32 torch reference of :mod:`flashinfer_ext.common.reference`
  (metadata from scratch each step). A correctness path for tests; no speed claim.

Where the host work goes (nothing per layer, no sync inside a step):
  * :meth:`begin_batch` (once per batch, SGLang's ``init_forward_metadata``): reads the host
    ``seq_lens_cpu`` / extend lengths and each request's epsilon (``custom_params``), builds the
    page table on the device and plans the wrapper (a few small host->device copies).
  * per layer, in batches with a sparse row only: one metadata fold launch, criticality + sort + progressive
    decode, and two in-place adds into the step-statistics buffer. No ``.item()``. Batches without a sparse
    row run the stock decode and touch no metadata.
Rows of a decode batch below ``min_context``, with epsilon 1.0, or sent dense by the adaptive switch
(``dense_above``; :func:`adaptive_dense`) attend their whole context. The switch decides from a probe:

  * a request whose prompt reaches ``min_context`` is probed at the end of its prefill: in the extend that writes
    its last prompt token, per layer, PSA's stop test runs for that token's query over the whole context
    (:meth:`_RunnerBase.extend_probe_rows`; such an extend runs eagerly, never from a prefill CUDA graph). Its
    output is discarded: the prefill is stock. Until the request's decision is read back (one step behind under
    the overlap scheduler) its decode steps are stock dense steps. A request the switch sends dense therefore
    decodes exactly as ``--sparse off`` does, every token;
  * a request that reaches ``min_context`` only while decoding runs ``probe_steps`` decode probe steps: the PSA
    kernel at epsilon 1.0 (every block: the exact result up to rounding) while its stop test records, at the
    row's epsilon, how many blocks PSA would read (``PsaDecodeWrapper.probe_nread``; on the CPU the stock output
    is kept and the reference counts the reads).

If every row of a decode batch attends its whole context, the stock FlashInfer decode runs (SGLang's stock decode
graph); in a mixed batch those rows run the sparse kernel with epsilon 1.0 (all blocks), which is exact but not
FlashInfer-fast.

CUDA graphs (decode): a batch with at least one sparse row replays a graph captured over the PSA
path (:meth:`PsaCudaRunner.begin_graph_batch` plans into the wrapper's fixed ``_buf`` tensors with
the full ranking width before each replay; rows that are not sparse get epsilon 1.0 there); a batch
with no sparse row replays SGLang's stock graph (:mod:`sglang_sparse.graph_variants`). Extends do
no metadata work, so every extend batch may replay SGLang's prefill graphs.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch

from flashinfer_ext.psa.config import PsaDecodeConfig
from sglang_sparse.config import PsaConfig
from sglang_sparse.psa.stats import (COL_EPS, COL_KEPT, COL_READ, COL_SPARSE, COL_TOTAL, COL_UNITS,
                                     ROW_ADAPTIVE_DENSE, ROW_PREFILL_PROBE, ROW_PROBE, ROW_SPARSE, STEP_COLS)
from sglang_sparse.psa.switch import _PREFILL_PROBE_ATTR, _decided, _epsilons_of, extend_probe_rows, switch_state
from sglang_sparse.request_params import ReplayRequests, batch_requests


def kernel_config(cfg: PsaConfig) -> PsaDecodeConfig:
    """Map the user-facing :class:`PsaConfig` onto the kernel's :class:`PsaDecodeConfig`."""
    mean = cfg.estimator == "mean"  # estimates unread blocks from q . mean key: scores are the mean scores
    return PsaDecodeConfig(epsilon=cfg.epsilon, micro_batch_blocks=cfg.micro_batch_blocks,
                           sink_blocks=cfg.sink_pages, local_blocks=cfg.local_pages, max_blocks=cfg.max_blocks,
                           estimator=cfg.estimator, criticality="mean" if mean else "cuboid")


@dataclasses.dataclass(frozen=True)
class AttnShape:
    """Attention shape of the model served (per TP rank)."""

    num_layers: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, model_runner) -> "AttnShape":
        """The shape SGLang's ``ModelRunner`` serves (this TP rank's heads, the KV pool's layers)."""
        mc = model_runner.model_config
        tp = int(getattr(model_runner, "tp_size", 1) or 1)
        return cls(num_layers=int(model_runner.token_to_kv_pool.layer_num),
                   num_qo_heads=int(mc.num_attention_heads) // tp, num_kv_heads=int(mc.get_num_kv_heads(tp)),
                   head_dim=int(mc.head_dim))

    @property
    def units(self) -> int:
        """(layer, KV head) pairs: the unit of blocks-read accounting."""
        return self.num_layers * self.num_kv_heads


_META_ATTR = "_sparse_psa_meta"    # on a scheduler ``Req``: (retraction_count, tokens its block metadata covers)


def _meta_key(req, covered: int) -> tuple[int, int]:
    """What a request's block metadata is valid for: its pages since the last retraction, ``covered`` tokens."""
    return int(getattr(req, "retraction_count", 0) or 0), int(covered)


def _rids_of(reqs, bs: int) -> list:
    """The rows' request ids (``None`` where there is no ``Req``), for the working-set tracker."""
    rids = [getattr(r, "rid", None) for r in list(reqs or ())[:bs]]
    return rids + [None] * (bs - len(rids))


def _row_rids(forward_batch, bs: int) -> list:
    return _rids_of(batch_requests(forward_batch), bs)


class _RunnerBase:
    """Shared batch bookkeeping: which rows decode sparsely, their epsilons, the step rows."""

    def __init__(self, cfg: PsaConfig, block_size: int, shape: AttnShape, device: torch.device):
        self.cfg = cfg
        self.kernel_cfg = kernel_config(cfg)
        self.block_size = block_size
        self.shape = shape
        self.device = device
        self.bs = 0
        self.is_decode = False
        self.sparse_batch = False
        self._sparse_host: torch.Tensor | None = None
        self._row_reqs: list = []  # the current batch's ``Req`` per row (None: unknown, padding)
        self._xp_rows: list[int] = []  # rows of the current extend batch probed at the end of their prefill
        self._xp_qidx_host: list[int] = []
        self._eps_host: torch.Tensor | None = None
        self._probe_host: torch.Tensor | None = None
        self._rows_host: tuple = ((), (), (), ())  # (lens, eps, sparse, probe) host lists of the planned batch
        self.step_rows: torch.Tensor | None = None  # [bs, STEP_COLS] fp32: on self.device in batches with a sparse row, else host
        self.graph_mode = False  # the current batch replays (or captures) a decode CUDA graph
        self._replay = ReplayRequests()  # the real batch's requests for a graph replay view (no sampling_info)
        self._gate_state: tuple | None = None  # (eps, switched, probing) per row of the batch wants_graph last kept
        self._graph_decided = (None, None)  # (forward batch, variant) of the last graph_variant answer
        self.ws = None  # WorkingSetTracker (host tier admission; set by psa.backend.make_runner) or None
        self._ws_step = False  # this decode step records its selections into ``ws``

    def _row_state(self, reqs, bs: int) -> tuple[list[float], list[bool], list[bool]]:
        """Per-row ``(epsilon, switched_dense, probing)`` of ``reqs`` (host lists of ``bs``)."""
        return (_epsilons_of(self.cfg, reqs, bs), *switch_state(self.cfg, reqs, bs))

    def extend_probe_rows(self, forward_batch) -> list[int]:
        """Rows of an extend batch probed at the end of their prefill (:func:`sglang_sparse.psa.switch.extend_probe_rows`)."""
        return extend_probe_rows(self.cfg, forward_batch)

    def _plan_extend_probe(self, forward_batch) -> list[int]:
        """Host plan of an extend batch's prefill probes: marks the requests, fills their step rows (kind 4,
        ``blocks_total``, ``units``) and ``_xp_qidx_host`` (each probe row's last extend token in the batch's
        flattened queries). Returns the probe rows."""
        rows = self.extend_probe_rows(forward_batch)
        self._xp_rows = rows
        if not rows:
            return rows
        ends = list(itertools.accumulate(int(x) for x in forward_batch.extend_seq_lens_cpu))
        self._xp_qidx_host = [ends[i] - 1 for i in rows]
        units = self.shape.units
        lens = forward_batch.seq_lens_cpu
        for i in rows:
            setattr(self._row_reqs[i], _PREFILL_PROBE_ATTR, True)
            self.step_rows[i, COL_SPARSE] = float(ROW_PREFILL_PROBE)
            self.step_rows[i, COL_UNITS] = float(units)
            self.step_rows[i, COL_TOTAL] = float(-(-int(lens[i]) // self.block_size) * units)
        return rows

    def _row_kinds(self, lens: list[int], eps: list[float], off: list[bool]) -> tuple[list[bool], list[bool]]:
        """``(sparse, switched)`` per row. Long rows (context >= ``min_context``, epsilon < 1) decode through PSA
        unless the adaptive switch sent them dense (``switched``). Only sparse rows keep block metadata current
        in decode; every other row decodes with the stock path. Host lists: no tensor op per step."""
        mc = self.cfg.min_context
        long = [n >= mc and e < 1.0 for n, e in zip(lens, eps)]
        return [a and not o for a, o in zip(long, off)], [a and o for a, o in zip(long, off)]

    def wants_graph(self, forward_batch) -> bool:
        """Host test before a decode graph replay: graphs only for batches with a sparse row.

        Also keeps this batch's requests for :meth:`begin_graph_batch` (:class:`ReplayRequests`): SGLang hands
        the backend a replay view without ``sampling_info``; the view's lengths identify the batch.
        """
        lens = forward_batch.seq_lens_cpu
        if lens is None:
            return False
        bs = int(forward_batch.batch_size)
        eps, off, probe = self._row_state(batch_requests(forward_batch), bs)
        self._replay.keep(forward_batch)
        self._gate_state = (eps, off, probe)  # reused by the replay's plan (_stashed_state): one read per step
        return any(self._row_kinds(lens[:bs].tolist(), eps, off)[0])

    def graph_variant(self, forward_batch, peek: bool = False) -> str | None:
        """Which decode graph this batch replays (:mod:`sglang_sparse.graph_variants`): ``"sparse"`` when a row
        is sparse (:meth:`wants_graph`), else ``"dense"`` (SGLang's stock graph: short rows, rows with epsilon
        1.0 and rows the adaptive switch sent dense keep no metadata). ``peek``: the answer already given for
        this batch, nothing new kept."""
        if peek:
            fb, variant = self._graph_decided
            return variant if fb is forward_batch else None
        if forward_batch.seq_lens_cpu is None:
            v = None
        else:
            v = "sparse" if self.wants_graph(forward_batch) else "dense"
        self._graph_decided = (forward_batch, v)
        return v

    def begin_dense_graph_batch(self, forward_batch, in_capture: bool) -> None:
        """Plan a decode batch that captures or replays the stock graph: no sparse row, no metadata fold; the
        rows' statistics as an eager dense step writes them."""
        bs = int(forward_batch.batch_size)
        self._plan_rows(forward_batch, True, state=None if in_capture else self._stashed_state(forward_batch, bs))
        self.graph_mode, self.sparse_batch, self._ws_step = False, False, False
        if in_capture:
            self.step_rows = None

    def _stashed_rids(self, forward_batch, bs: int) -> list | None:
        """Request ids of a graph replay view's rows, from :meth:`wants_graph`'s kept batch (padding -> None)."""
        got = self._replay.recover(forward_batch, bs)
        return None if got is None else _rids_of(got[1][:got[0]], bs)

    def _stashed_state(self, forward_batch, bs: int) -> tuple | None:
        """Per-row ``(epsilon, switched_dense, probing, reqs)`` of the batch kept by :meth:`wants_graph` for this
        (padded) replay view, if it matches; padding rows are dense (epsilon 1.0: they are short fill rows)."""
        got = self._replay.recover(forward_batch, bs)
        if got is None:
            return None
        n, reqs = got
        kept = self._gate_state
        eps, off, probe = kept if kept is not None and len(kept[0]) == n else self._row_state(reqs, n)
        # (kept: wants_graph's answer for this batch, whose lengths the view matched)
        pad = bs - n
        return (list(eps) + [1.0] * pad, list(off) + [False] * pad, list(probe) + [False] * pad,
                list(reqs[:n]) + [None] * pad)

    def _plan_ws(self, rids: list, num_cols: int, pad_to: int | None = None) -> None:
        """Host plan of the working-set tracker for a decode step that records (once per batch): slots of
        the rows' requests (absent ones released), then the step's device-side bases."""
        self._ws_step = self.ws is not None
        if not self._ws_step:
            return
        keyed = any(r is not None for r in rids)  # a replay view without its requests keeps every slot
        self.ws.plan_rows(self.ws.assign(rids, release_absent=keyed), num_cols, pad_to=pad_to)
        self.ws.begin_step()

    def _plan_rows(self, forward_batch, decode: bool, state: tuple | None = None) -> None:
        """Host plan of a batch's rows. ``state``: ``(eps, off, probe, reqs)`` of a graph replay view
        (:meth:`_stashed_state`); otherwise read from the batch's own requests. A batch without a sparse row
        (the common steady state once requests switched, and every short batch) costs host lists and one
        small tensor; the sparse path's tensors (:meth:`_row_tensors`) are built only when a row is sparse."""
        bs = int(forward_batch.batch_size)
        self.bs, self.is_decode, self.graph_mode = bs, decode, False
        if state is None:
            reqs = list(batch_requests(forward_batch) or ())[:bs]
            eps, off, probe = self._row_state(reqs, bs)
        else:
            eps, off, probe, reqs = state
        self._row_reqs = list(reqs) + [None] * (bs - len(reqs))
        lens = forward_batch.seq_lens_cpu
        if decode and lens is not None:
            lens = lens[:bs].tolist()
            sparse, switched = self._row_kinds(lens, eps, off)
        else:
            sparse = switched = [False] * bs
        self.sparse_batch = any(sparse)
        probe = [s and p for s, p in zip(sparse, probe)]  # probe steps: exact result, PSA's reads counted
        self._rows_host = (lens, eps, sparse, probe)
        self._sparse_host = self._eps_host = self._probe_host = None
        self._ws_step = False
        rows = [[0.0] * STEP_COLS for _ in range(bs)]
        for i in range(bs):
            rows[i][COL_EPS] = eps[i]
            # a switched row is reported as such once decided (before: a stock step awaiting its prefill probe)
            rows[i][COL_SPARSE] = float(ROW_ADAPTIVE_DENSE) if switched[i] and _decided(self._row_reqs[i]) else 0.0
        if not self.sparse_batch:
            # no kernel writes into the rows of a batch without a sparse row: they stay on the host (no copy
            # either way; psa_step_rows hands a host tensor to SGLang as is)
            self.step_rows = torch.tensor(rows, dtype=torch.float32).reshape(bs, STEP_COLS)
            return
        units = self.shape.units
        for i in range(bs):
            if sparse[i]:
                rows[i][COL_SPARSE], rows[i][COL_UNITS] = float(ROW_PROBE if probe[i] else ROW_SPARSE), float(units)
                rows[i][COL_TOTAL] = float(-(-int(lens[i]) // self.block_size) * units)
        host = torch.tensor(rows, dtype=torch.float32)
        self._row_tensors()
        self.step_rows = host.to(self.device, non_blocking=True) if self.device.type != "cpu" else host

    def _row_tensors(self) -> None:
        """``_sparse_host`` / ``_probe_host`` (bool ``[bs]``) and ``_eps_host`` (fp32 ``[bs]``) of the planned rows,
        for the sparse path (its wrapper plan, the CPU reference, the metadata plan)."""
        _, eps, sparse, probe = self._rows_host
        self._sparse_host = torch.tensor(sparse, dtype=torch.bool).reshape(len(sparse))
        self._probe_host = torch.tensor(probe, dtype=torch.bool).reshape(len(probe))
        self._eps_host = torch.tensor(eps, dtype=torch.float32).reshape(len(eps))


class PsaCpuRunner(_RunnerBase):
    """CPU: the fp32 reference (metadata from scratch, stable rank, PSA Alg. 1) for the sparse rows."""

    def begin_batch(self, backend, forward_batch) -> None:
        decode = forward_batch.forward_mode.is_decode()
        self._plan_rows(forward_batch, decode)
        self._xp_rows = [] if decode else self._plan_extend_probe(forward_batch)
        if self.sparse_batch and self.ws is not None:
            max_len = int(forward_batch.seq_lens_cpu[: self.bs].max())
            self._plan_ws(_row_rids(forward_batch, self.bs), -(-max_len // self.block_size))

    def after_extend(self, backend, q, layer, forward_batch) -> None:
        """Prefill probes: the reference's stop test for each probe row's last prompt query (metadata from scratch);
        the blocks it reads are added to the row's step statistics. Decode metadata is rebuilt at each step."""
        if not self._xp_rows:
            return None
        from flashinfer_ext.common.reference import psa_decode_reference

        num_qo, d = layer.tp_q_head_num, layer.head_dim
        rows = torch.tensor(self._xp_rows, dtype=torch.long)
        q3 = q.reshape(-1, num_qo, d)[torch.tensor(self._xp_qidx_host, dtype=torch.long)]
        k_buf = backend.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_buf = backend.token_to_kv_pool.get_value_buffer(layer.layer_id)
        eps = [float(self.step_rows[i, COL_EPS]) for i in self._xp_rows]
        for e in sorted(set(eps)):
            sel = torch.tensor([j for j, x in enumerate(eps) if x == e], dtype=torch.long)
            cfg = dataclasses.replace(self.kernel_cfg, epsilon=e)
            r = rows[sel]
            _, _, nread, _ = psa_decode_reference(q3[sel], k_buf, v_buf, backend.req_to_token_pool.req_to_token,
                                                  forward_batch.req_pool_indices[r], forward_batch.seq_lens[r], cfg,
                                                  block_size=self.block_size, sm_scale=layer.scaling)
            self.step_rows[r, COL_READ] += nread.sum(1).float()
        return None

    def decode(self, backend, q, k, v, layer, forward_batch, save_kv_cache):
        # stock path first: writes the new K/V and gives dense outputs for every row
        o = backend._psa_base.forward_decode(backend, q, k, v, layer, forward_batch, save_kv_cache)
        if not self.sparse_batch:
            return o
        from flashinfer_ext.common.reference import kept_mass_reference, psa_decode_reference

        num_qo, d = layer.tp_q_head_num, layer.head_dim
        q3 = q.reshape(-1, num_qo, d)
        k_buf = backend.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_buf = backend.token_to_kv_pool.get_value_buffer(layer.layer_id)
        rtt = backend.req_to_token_pool.req_to_token
        rows_all = torch.nonzero(self._sparse_host).flatten()
        for eps in torch.unique(self._eps_host[rows_all]).tolist():
            rows = rows_all[self._eps_host[rows_all] == eps]
            cfg = dataclasses.replace(self.kernel_cfg, epsilon=float(eps))
            rpi, lens = forward_batch.req_pool_indices[rows], forward_batch.seq_lens[rows]
            o_s, _, nread, order = psa_decode_reference(q3[rows], k_buf, v_buf, rtt, rpi, lens, cfg,
                                                        block_size=self.block_size, sm_scale=layer.scaling)
            out = ~self._probe_host[rows]  # probe rows keep the stock (exact) output; their reads are counted
            o.view(-1, num_qo, d)[rows[out]] = o_s[out].to(o.dtype)
            if self._ws_step:
                self.ws.record_rows(layer.layer_id, rows, order[:, :, : self.ws._ncols], nread)
            kept = kept_mass_reference(q3[rows], k_buf, rtt, rpi, lens, order, nread,
                                       block_size=self.block_size, sm_scale=layer.scaling)
            group = num_qo // k_buf.shape[1]
            self.step_rows[rows, COL_READ] += nread.sum(1).float()
            self.step_rows[rows, COL_KEPT] += kept.view(len(rows), -1, group).amin(-1).sum(1)
        return o


class PsaCudaRunner(_RunnerBase):
    """GPU: block metadata beside the KV pool + :class:`PsaDecodeWrapper`; the page is the block.

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
                 out_dtype: torch.dtype):
        super().__init__(cfg, block_size, shape, device)
        from flashinfer_ext.psa.block_meta import BlockMetaPool
        from flashinfer_ext.psa.decode import PsaDecodeWrapper

        k0 = token_to_kv_pool.get_key_buffer(0)
        num_rows = -(-k0.shape[0] // block_size) + 1
        self.meta = BlockMetaPool(shape.num_layers, num_rows, shape.num_kv_heads, shape.head_dim, block_size,
                                  dtype=k0.dtype, device=device, layout=PsaDecodeWrapper.META_LAYOUT)
        self.pool = token_to_kv_pool
        self._req_to_token = req_to_token  # SGLang's ReqToTokenPool.req_to_token: one tensor for the server's life
        self.max_blocks_per_req = -(-req_to_token.shape[1] // block_size)
        self.wrapper = PsaDecodeWrapper(
            self.kernel_cfg, num_qo_heads=shape.num_qo_heads, num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim, block_size=block_size, max_batch_size=max_batch_size,
            max_blocks_per_req=self.max_blocks_per_req, device=device, sm_scale=sm_scale, out_dtype=out_dtype)
        i32 = dict(dtype=torch.int32, device=device)
        self._step_buf = torch.zeros(max_batch_size, STEP_COLS, dtype=torch.float32, device=device)
        self._rpi_buf = torch.zeros(max_batch_size, **i32)          # fixed: read inside decode graphs
        self._table_buf = torch.zeros(max_batch_size, self.max_blocks_per_req, **i32)
        self._meta_start_buf = torch.zeros(max_batch_size, **i32)   # decode: per-row fold range
        self._meta_end_buf = torch.zeros(max_batch_size, **i32)
        self._nread_sum_buf = torch.zeros(max_batch_size, dtype=torch.float32, device=device)
        self._kept_sum_buf = torch.zeros(max_batch_size, dtype=torch.float32, device=device)
        self.meta_rebuilds = 0        # rows whose metadata was rebuilt from position 0 (first sparse step, ...)
        self._xp = None               # device tensors of the current extend batch's prefill probes

    def meta_bytes(self) -> int:
        return 3 * self.meta.kmin.numel() * self.meta.kmin.element_size()

    def rebuild_page_meta(self, pages: torch.Tensor) -> None:
        """Host tier load listener: recompute (min, max, mean) of whole pages ``pages`` (int64 ``[n]`` on the
        device, full pages of reloaded radix nodes) for every layer from the keys now in them (the metadata
        is recomputed from the reloaded KV, not carried through the host). The mean is taken in fp32 over
        the page, which may differ in the last bit from the kernel's incremental mean."""
        p = self.block_size
        for lid in range(self.shape.num_layers):
            k = self.pool.get_key_buffer(lid)
            n = k.shape[0] // p
            kp = k[: n * p].view(n, p, k.shape[1], k.shape[2]).index_select(0, pages)  # [n_pages, P, H, D]
            kmin, kmax, kmean = self.meta.layer(lid)
            kmin.index_copy_(0, pages, kp.amin(1).to(kmin.dtype))
            kmax.index_copy_(0, pages, kp.amax(1).to(kmax.dtype))
            kmean.index_copy_(0, pages, kp.float().mean(1).to(kmean.dtype))

    def _block_table(self, req_pool_indices: torch.Tensor, max_len: int) -> torch.Tensor:
        """``[rows, ceil(max_len / block)]`` int32 page ids of the rows ``req_pool_indices``."""
        from flashinfer_ext.psa.block_meta import paged_block_table

        width = max(1, -(-int(max_len) // self.block_size))
        return paged_block_table(self._req_to_token, req_pool_indices,
                                 self.block_size, width)

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
            if req is None or getattr(req, _META_ATTR, None) != _meta_key(req, n - 1):
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
        from flashinfer_ext.psa.block_meta import update_block_meta

        bs = self.bs
        kmin, kmax, kmean = self.meta.layer(layer_id)
        update_block_meta(self.pool.get_key_buffer(layer_id), kmin, kmax, kmean,
                          self._req_to_token, self._rpi_buf[:bs], self._table_buf[:bs],
                          self._meta_start_buf[:bs], self._meta_end_buf[:bs], block_size=self.block_size,
                          max_new_blocks=1)

    def _plan_wrapper(self, forward_batch, table: torch.Tensor, max_len: int | None) -> None:
        """Plan the PSA wrapper: rows that are not sparse, and probe rows, read everything (epsilon 1.0); the probe
        threshold is each sparse row's epsilon (a probe row's reads at it land in ``probe_nread``).
        ``max_len`` None: the full ranking width (graphs)."""
        probe_eps = torch.where(self._sparse_host, self._eps_host, 1.0)
        both = torch.stack([torch.where(self._probe_host, 1.0, probe_eps), probe_eps])
        both = both.to(self.device, non_blocking=True)  # one copy: [epsilon; probe epsilon]
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
        self._plan_rows(forward_batch, True, state=None if in_capture else self._stashed_state(forward_batch, bs))
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
        self.wrapper.run(q_rows, k_buf, v_buf, *self.meta.layer(lid))
        torch.sum(self.wrapper.probe_nread, 1, dtype=torch.float32, out=xp["nread_sum"])
        self.step_rows[:, COL_READ].index_add_(0, xp["rows"], xp["nread_sum"])
        return None

    def decode(self, backend, q, k, v, layer, forward_batch, save_kv_cache):
        pool = backend.token_to_kv_pool
        lid = layer.layer_id
        if not self.sparse_batch and not self.graph_mode:
            # no sparse row: stock decode, no metadata (a request's metadata is rebuilt at its next sparse step)
            return backend._psa_base.forward_decode(backend, q, k, v, layer, forward_batch, save_kv_cache)
        if k is not None and save_kv_cache:
            _write_kv(backend, pool, layer, forward_batch, k, v)
        k_buf, v_buf = pool.get_key_buffer(lid), pool.get_value_buffer(lid)
        self._fold_decode_meta(lid)
        kmin, kmax, kmean = self.meta.layer(lid)
        num_qo, d = layer.tp_q_head_num, layer.head_dim
        o, _, nread = self.wrapper.run(q.reshape(-1, num_qo, d), k_buf, v_buf, kmin, kmax, kmean)
        rows, bs = self.step_rows, self.bs  # statistics: in-place, into preallocated buffers
        # blocks read at each row's epsilon: a sparse row's reads; a probe row's reads had it run sparsely
        torch.sum(self.wrapper.probe_nread, 1, dtype=torch.float32, out=self._nread_sum_buf[:bs])
        torch.sum(self.wrapper.kept_est, 1, out=self._kept_sum_buf[:bs])
        rows[:, COL_READ].add_(self._nread_sum_buf[:bs])
        rows[:, COL_KEPT].add_(self._kept_sum_buf[:bs])
        if self._ws_step:  # working set: one index_put into the tracker (graph-safe, no sync)
            self.ws.record(lid, self.wrapper.order, nread)
        return o.reshape(-1, num_qo * d)


def _write_kv(backend, pool, layer, forward_batch, k, v) -> None:
    """Write the decode token's K/V exactly as the stock FlashInfer backend does."""
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    swa = getattr(getattr(backend, "forward_metadata", None), "swa_out_cache_loc", None)
    scales = backend._kv_write_scales(layer) if hasattr(backend, "_kv_write_scales") else (layer.k_scale, layer.v_scale)
    pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, swa), k, v, *scales)
