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
  * per layer, in batches with a sparse row only: one metadata fold launch and the wrapper's decode (criticality,
    ranking and progressive waves; or with ``schedule: select`` the sketch masses, the selection and one split
    pass), which leaves the layer's read counts and kept-mass estimates in the wrapper's slot for that layer. After
    the last layer, two sums and two in-place adds fold every layer's into the step-statistics buffer (once per
    step: the launches cost more than the sums at this model's small shapes). No ``.item()``. Batches without a
    sparse row run the stock decode and touch no metadata.
Rows of a decode batch below ``min_context``, with epsilon 1.0, or sent dense by the adaptive switch
(``dense_above``; :func:`adaptive_dense`) attend their whole context. The switch decides from a probe:

  * a request whose prompt reaches ``min_context`` is probed at the end of its prefill: in the extend that writes
    its last prompt token, per layer, PSA's stop test runs for that token's query over the whole context
    (:meth:`_RunnerBase.extend_probe_rows`; planned in :meth:`begin_batch`, run after each layer's stock attention,
    which SGLang's breakable prefill graphs call eagerly between their captured segments, so such an extend may
    replay them like any other). Its output is discarded: the prefill is stock. Until the request's decision is
    read back (one step behind under the overlap scheduler) its decode steps are stock dense steps. A request the
    switch sends dense therefore decodes exactly as ``--sparse off`` does, every token;
  * a request that reaches ``min_context`` only while decoding runs ``probe_steps`` decode probe steps: the PSA
    kernel at epsilon 1.0 (every block: the exact result up to rounding) while its stop test records, at the
    row's epsilon, how many blocks PSA would read (``PsaDecodeWrapper.probe_nread``; on the CPU the stock output
    is kept and the reference counts the reads).

If every row of a decode batch attends its whole context, the stock FlashInfer decode runs (SGLang's stock decode
graph); in a mixed batch those rows run the sparse kernel with epsilon 1.0 (all blocks), which is exact but not
FlashInfer-fast and rounds unlike the stock decode; with ``stock_rows`` 'exact' (the default under deterministic
inference) the CUDA runner also runs the stock decode over the batch and those rows take its output, as the CPU
runner always does.

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
from sglang_sparse.request_params import ReplayRequests, batch_requests, host_ints
from sglang_sparse.stats import host_row


def kernel_config(cfg: PsaConfig) -> PsaDecodeConfig:
    """Map the user-facing :class:`PsaConfig` onto the kernel's :class:`PsaDecodeConfig`."""
    # 'mean' estimates unread blocks from q . mean key (the mean scores); 'sketch' from the int4 key sketch's shares
    crit = {"mean": "mean", "sketch": "sketch"}.get(cfg.estimator, "cuboid")
    return PsaDecodeConfig(epsilon=cfg.epsilon, micro_batch_blocks=cfg.micro_batch_blocks,
                           sink_blocks=cfg.sink_pages, local_blocks=cfg.local_pages, max_blocks=cfg.max_blocks,
                           estimator=cfg.estimator, criticality=crit, schedule=cfg.schedule,
                           calib_slack=cfg.calib_slack)


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
        # a decode batch on the stock decode (no sparse row, not a sparse-graph plan): its rows as host tuples
        # ``(rows, plain)`` instead of ``step_rows``; ``plain``: no row the counters count (shared between steps)
        self.dense_rows: tuple | None = None
        self.graph_mode = False  # the current batch replays (or captures) a decode CUDA graph
        self._replay = ReplayRequests()  # the real batch's requests for a graph replay view (no sampling_info)
        self._gate_state: tuple | None = None  # (eps, switched, probing) per row of the batch wants_graph last kept
        self._graph_decided = (None, None)  # (forward batch, variant) of the last graph_variant answer
        self.ws = None  # WorkingSetTracker (host tier admission; set by psa.backend.make_runner) or None
        self._ws_step = False  # this decode step records its selections into ``ws``

    def _row_state(self, reqs, bs: int, lens=None) -> tuple[list[float], list[bool], list[bool]]:
        """Per-row ``(epsilon, switched_dense, probing)`` of ``reqs`` (host lists of ``bs``); ``lens``: the rows'
        context lengths (host), so rows below ``min_context`` skip the switch."""
        eps = _epsilons_of(self.cfg, reqs, bs)
        if lens is not None and max(lens, default=0) < self.cfg.min_context:  # every row short: no switch state
            return eps, [False] * bs, [False] * bs
        return (eps, *switch_state(self.cfg, reqs, bs, lens))

    def extend_probe_rows(self, forward_batch) -> list[int]:
        """Rows of an extend batch probed at the end of their prefill (:func:`sglang_sparse.psa.switch.extend_probe_rows`)."""
        return extend_probe_rows(self.cfg, forward_batch)

    def _plan_extend_probe(self, forward_batch) -> list[int]:
        """Host plan of an extend batch's prefill probes: marks the requests, fills their step rows (kind 4,
        ``blocks_total``, ``units``) and ``_xp_qidx_host`` (each probe row's last extend token in the batch's
        flattened queries). Returns the probe rows."""
        rows = self._admit_probe_rows(self.extend_probe_rows(forward_batch), forward_batch)
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

    def _admit_rows(self, sparse: list[bool], lens: list[int], reqs: list) -> list[bool]:
        """The sparse rows of a decode batch that get block metadata (all of them here; see
        :meth:`PsaCudaRunner._admit_rows` for page size 1). A row not admitted attends its whole context."""
        return sparse

    def _admit_probe_rows(self, rows: list[int], forward_batch) -> list[int]:
        """The prefill-probe rows of an extend batch that get block metadata (all of them here)."""
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
        lens = lens[:bs].tolist()
        eps, off, probe = self._row_state(batch_requests(forward_batch), bs, lens)
        self._replay.keep(forward_batch)
        self._gate_state = (eps, off, probe)  # reused by the replay's plan (_stashed_state): one read per step
        return any(self._row_kinds(lens, eps, off)[0])

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
            self.step_rows = self.dense_rows = None

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
        lens = forward_batch.seq_lens_cpu
        eps, off, probe = (kept if kept is not None and len(kept[0]) == n
                           else self._row_state(reqs, n, None if lens is None else lens[:n].tolist()))
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

    def _plan_rows(self, forward_batch, decode: bool, state: tuple | None = None, tensor_rows: bool = False) -> None:
        """Host plan of a batch's rows. ``state``: ``(eps, off, probe, reqs)`` of a graph replay view
        (:meth:`_stashed_state`); otherwise read from the batch's own requests. A decode batch without a sparse
        row (every short batch, and the steady state once requests switched) costs host lists only: its rows
        become :attr:`dense_rows` (host tuples, no tensor, no copy), unless ``tensor_rows`` (a sparse-graph plan,
        whose graph writes into ``step_rows``); the sparse path's tensors (:meth:`_row_tensors`) are built only
        when a row is sparse."""
        bs = int(forward_batch.batch_size)
        self.bs, self.is_decode, self.graph_mode = bs, decode, False
        self.dense_rows = None
        lens = None if forward_batch.seq_lens_cpu is None else host_ints(forward_batch.seq_lens_cpu, bs)
        if state is None:
            reqs = list(batch_requests(forward_batch) or ())[:bs]
            eps, off, probe = self._row_state(reqs, bs, lens)
        else:
            eps, off, probe, reqs = state
        self._row_reqs = list(reqs) + [None] * (bs - len(reqs))
        if decode and lens is not None and max(lens, default=0) >= self.cfg.min_context:
            sparse, switched = self._row_kinds(lens, eps, off)
            sparse = self._admit_rows(sparse, lens, self._row_reqs)
        else:  # an extend, or every row short (the common case below min_context): no sparse row
            sparse = switched = [False] * bs
        self.sparse_batch = any(sparse)
        probe = [s and p for s, p in zip(sparse, probe)]  # probe steps: exact result, PSA's reads counted
        self._rows_host = (lens, eps, sparse, probe)
        self._sparse_host = self._eps_host = self._probe_host = None
        self._ws_step = False
        # a switched row is reported as such once decided (before: a stock step awaiting its prefill probe)
        kinds = [float(ROW_ADAPTIVE_DENSE) if switched[i] and _decided(self._row_reqs[i]) else 0.0 for i in range(bs)]
        if decode and not self.sparse_batch and not tensor_rows:
            self.step_rows = None
            self.dense_rows = tuple(host_row(STEP_COLS, {COL_SPARSE: k, COL_EPS: e}) for k, e in zip(kinds, eps)), \
                not any(kinds)
            return
        rows = [[0.0] * STEP_COLS for _ in range(bs)]
        for i in range(bs):
            rows[i][COL_EPS] = eps[i]
            rows[i][COL_SPARSE] = kinds[i]
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
