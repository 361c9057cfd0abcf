"""PSA progressive threshold decode (PSA Alg. 1) as a FlashInfer-style plan()/run() wrapper.

Supports: a batch of decode requests over SGLang's KV pool (``[num_slots, num_kv_heads,
head_dim]`` per layer, ``req_to_token``), block metadata from
:mod:`flashinfer_ext.psa.block_meta` (page size > 1: blocks = pages; page size 1: logical
blocks of ``block_size`` positions), GQA with the query-head group taken into the
criticality bound explicitly, bf16/fp16, a per-request epsilon (a row with
``epsilon >= 1`` attends every block of its context: the dense result).

Per layer, :meth:`PsaDecodeWrapper.run` launches a fixed sequence of device ops:
criticality (Triton; fp32 scores + int16 sort keys) -> ranking (:mod:`flashinfer_ext.psa.rank_select`:
exact top-``sorted_prefix_blocks`` then block order; or a full device sort) ->
remaining-mass bound suffix (Triton;
'bound'/'calibrated' estimators only) -> for each *wave* of the host plan: chunk
attention (:mod:`flashinfer_ext.psa.chunks`, one program per (request, KV head, chunk),
pairs already done exit at once) + merge with the stop test chunk by chunk
(:mod:`flashinfer_ext.psa.wave_merge`). The result equals sequential PSA with the chunk
schedule of :meth:`PsaDecodeConfig.ranked_chunk_ends` (reference:
:func:`flashinfer_ext.common.reference.progressive_decode_reference`), whatever the wave layout.
With ``schedule='select'`` (key sketch only) a layer is instead: sketch block masses -> the sketch's top-p
lists (:mod:`flashinfer_ext.psa.sketch_select`, one launch) -> the split-list decode over them and its merge
(:mod:`flashinfer_ext.common.split_decode`, two launches); ``order`` then holds each pair's selected blocks in
block order (its first ``nread`` entries) and there are no waves.
No ``.item()``, no host sync, no allocation of its own, launch count fixed by
``(batch, num_cols)``: capture it in a CUDA graph and replay after :meth:`plan` refreshed
the preallocated ``_buf`` tensors in place.

Cautions:
  * :meth:`plan` once per batch (may run at graph replay time: device tensors only, no host
    reads); it derives forced counts / read caps / epsilon rows on the device.
  * For graph capture plan with ``max_seq_len=None`` (full ``max_blocks_per_req`` columns):
    the sort width and the wave plan must not change between capture and replay.
  * The new decode token's K/V must be in the pool and its block metadata updated
    (:meth:`update_meta_decode`) before :meth:`run`.
  * ``nread`` counts the blocks whose attention is in the result; the kernels read up to
    ``wave_growth`` times more in the last wave they run, and the first wave is sized to fill the
    GPU (``wave_programs``), so at batch 1 it can read far past the stop point (bandwidth, not
    latency; ``bench/psa_decode_bench.py`` reports both fractions).
  * Measured on an H100 (triton 3.6, one layer, CUDA graph, 128k context, batch 8, 32/8 heads,
    d 128, page 16, planted structure of the benchmark, eps 0.95, 'calibrated', rank_by 'mean'):
    ~300 us against ~1.5 ms for FlashInfer's dense decode. The criticality pass reads kmin, kmax and
    kmean of every block (~400 MB here: ~160 us at 2.5 TB/s, the copy peak being ~3 TB/s); ranking (~34 us),
    the bound suffix (~19 us), the waves' launches and merges (~93 us) are the rest
    (``bench/results/psa_stage_profile.md``).
"""

from __future__ import annotations

import math

import torch

from .block_meta import update_block_meta
from flashinfer_ext.common.split_decode import plan_splits, sparse_decode_split

from .key_sketch import sketch_block_mass, sketch_shares, update_key_sketch
from .sketch_select import sketch_select
from .config import PsaDecodeConfig
from .criticality import CritTile, block_criticality, bound_suffix, rank_blocks, suffix_tiles
from .chunks import plan_waves, psa_chunk_attention
from .rank_select import rank_select
from .wave_merge import wave_merge

__all__ = ["PsaDecodeWrapper"]


class PsaDecodeWrapper:
    """Progressive threshold decode for up to ``max_batch_size`` requests.

    Wave plan defaults: :attr:`WAVE_PROGRAMS_PER_SM`, :attr:`WAVE_GROWTH`, :attr:`MAX_WAVES`.

    Args:
      config: :class:`PsaDecodeConfig`.
      num_qo_heads, num_kv_heads, head_dim: attention shape (``num_qo_heads % num_kv_heads == 0``).
      block_size: tokens per block (the page size for page size > 1).
      max_batch_size: largest batch :meth:`plan` accepts.
      max_blocks_per_req: ``ceil(max_context_len / block_size)``; the sort width.
      sm_scale: softmax scale (default ``head_dim ** -0.5``).
      out_dtype: dtype of the attention output buffer.
      wave_programs: programs the first wave should launch (default 2 x SM count on CUDA).
      wave_growth: each next wave covers about this many times the ranks read so far (default 4).
      max_waves: most waves (the last takes every remaining chunk; default 5).
      crit_tile: launch shape of the criticality pass (:class:`~flashinfer_ext.psa.criticality.CritTile`;
        default :attr:`CRIT_TILE`, which suits a :class:`BlockMetaPool` of layout :attr:`META_LAYOUT`).
      The wave defaults come from ``bench/psa_decode_bench.py --wave-sweep`` on an H100
      (``bench/results/psa_wave_sweep.md``): against the former 4 x SM / 2 / 12 they cut a layer's time
      by 26 % at batch 1 / 128k and 13 % on the 32k testbed capture, and by 1-2 % at batch 8 / 128k and
      batch 32 / 32k (planted). The result does not depend on them: only the over-read of the last wave and
      the number of launches do.
    """

    WAVE_PROGRAMS_PER_SM = 2  # first-wave programs per SM on CUDA (16 programs on a CPU)
    WAVE_GROWTH = 4.0
    MAX_WAVES = 5
    # criticality launch shape and metadata layout, from ``bench/psa_decode_bench.py --crit-sweep`` on an H100
    # (bench/results/psa_crit_sweep.md): one KV head per program, 32 blocks, 8 warps, on interleaved metadata takes
    # the metadata pass at 128k batch 8 from 216 us (1.86 TB/s, [64 x 128] tiles) to 158 us (2.54 TB/s)
    CRIT_TILE = CritTile(tile_b=32, num_warps=8)
    META_LAYOUT = "interleaved"  # the BlockMetaPool layout a server allocates beside this wrapper
    # ranks per program of the tile-parallel bound suffix (two launches over (pair, tile) programs; one program per
    # pair scanning its row was 64 programs at 128k batch 8 and left most SMs idle: 25 -> 19 us)
    SUFFIX_TILE = 1024

    def __init__(self, config: PsaDecodeConfig, *, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                 block_size: int, max_batch_size: int, max_blocks_per_req: int,
                 device: str | torch.device = "cuda", sm_scale: float | None = None,
                 out_dtype: torch.dtype = torch.bfloat16, tile_tokens: int = 64,
                 wave_programs: int | None = None, wave_growth: float | None = None, max_waves: int | None = None,
                 crit_tile: CritTile | None = None, stat_slots: int = 1):
        if not isinstance(config, PsaDecodeConfig):
            raise TypeError(f"config must be a PsaDecodeConfig, got {type(config).__name__}")
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads={num_qo_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        if not 1 <= block_size <= 128 or block_size & (block_size - 1):
            raise ValueError(f"block_size={block_size} must be a power of two in [1, 128]")
        if int(stat_slots) < 1:
            raise ValueError(f"stat_slots={stat_slots} must be >= 1")
        self.config = config
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.group = num_qo_heads // num_kv_heads
        self.block_size = block_size
        self.max_batch_size = max_batch_size
        self.max_blocks_per_req = max_blocks_per_req
        self.sm_scale = float(head_dim ** -0.5 if sm_scale is None else sm_scale)
        self.tile_tokens = tile_tokens
        dev = torch.device(device)
        if wave_programs is None:
            wave_programs = (self.WAVE_PROGRAMS_PER_SM * torch.cuda.get_device_properties(dev).multi_processor_count
                             if dev.type == "cuda" else 16)
        wave_growth = self.WAVE_GROWTH if wave_growth is None else wave_growth
        max_waves = self.MAX_WAVES if max_waves is None else max_waves
        self.wave_programs, self.wave_growth, self.max_waves = int(wave_programs), float(wave_growth), int(max_waves)
        self.crit_tile = self.CRIT_TILE if crit_tile is None else crit_tile
        i32 = dict(dtype=torch.int32, device=dev)
        f32 = dict(dtype=torch.float32, device=dev)
        hk, g, d, mb, cols = num_kv_heads, self.group, head_dim, max_batch_size, max_blocks_per_req
        n = mb * hk * cols
        self._req_pool_indices_buf = torch.zeros(mb, **i32)
        self._seq_lens_buf = torch.zeros(mb, **i32)
        self._start_buf = torch.zeros(mb, **i32)
        self._n_forced_buf = torch.zeros(mb, **i32)
        self._eps_buf = torch.ones(mb, **f32)
        self._probe_eps_buf = torch.ones(mb, **f32)
        self._probe_lens_buf = torch.zeros(mb, **i32)
        self._list_lens_buf = torch.zeros(mb, hk, **i32)
        self._block_table_buf = torch.zeros(mb, cols, **i32)
        self._scores_buf = torch.empty(n, **f32)
        self._keys_buf = torch.empty(n, dtype=torch.int16, device=dev)
        self._sorted_keys_buf = torch.empty(n, dtype=torch.int16, device=dev)
        self._order_buf = torch.zeros(n, dtype=torch.int64, device=dev)
        self._prefix = config.ranking_prefix() if cols <= 65536 else 0
        self._select_scratch_buf = torch.empty(max(1, mb * hk * self._prefix), dtype=torch.int32, device=dev)
        self._suffix_buf = torch.empty(mb * hk * (cols + 1), **f32)
        self.sketch = config.criticality == "sketch"
        # sketch: per (request, KV head, query head) block masses and totals (flashinfer_ext.psa.key_sketch)
        self._mass_buf = torch.empty(mb * hk * g * cols if self.sketch else 1, **f32)
        self._tot_buf = torch.zeros(mb * hk * g if self.sketch else 1, **f32)
        # schedule 'select': the sketch's top-p lists read by one split pass (flashinfer_ext.common.split_decode)
        self.select = config.schedule == "select"
        self._split_plan = None
        # split partials: the most (rows x spans) over every batch size at full width
        rows = max(b * num_qo_heads * self._splits(b, cols).num_splits for b in range(1, mb + 1)) if self.select else 1
        self._split_o_buf = torch.empty(rows * d, **f32)
        self._split_lse_buf = torch.empty(rows, **f32)
        self._suffix_tiles_buf = torch.empty(mb * hk * suffix_tiles(cols, self.SUFFIX_TILE), **f32)
        ends = config.ranked_chunk_ends(cols)
        self._chunk_ends_buf = torch.tensor([0] + ends, **i32)
        # partial slots: the largest (pairs x widest wave) over every batch size at full width
        slots = 1 if self.select else max(
            b * hk * max(nc for _, nc in self._waves(b, cols)) for b in range(1, mb + 1))
        self._partial_slots = slots
        self._po_buf = torch.empty(slots * g * d, **f32)
        self._plse_buf = torch.empty(slots * g, **f32)
        self._pmin_buf = torch.empty(slots * g, **f32)
        self._pdmax_buf = torch.empty(slots * g, **f32)
        self._st_acc_buf = torch.empty(mb * hk * g * d, **f32)
        self._st_lse_buf = torch.empty(mb * hk * g, **f32)
        self._st_min_buf = torch.empty(mb * hk * g, **f32)
        self._st_dmax_buf = torch.empty(mb * hk * g, **f32)
        self._done_buf = torch.zeros(mb * hk, **i32)
        self._o_buf = torch.empty(mb, num_qo_heads, head_dim, dtype=out_dtype, device=dev)
        self._lse_buf = torch.empty(mb, num_qo_heads, **f32)
        self._nread_buf = torch.zeros(mb, hk, **i32)
        # per-run statistics, one slot per layer of a step (``stat_slots``): a caller sums them once per step
        self._kept_all_buf = torch.ones(int(stat_slots), mb, hk, **f32)
        self._probe_nread_all_buf = torch.zeros(int(stat_slots), mb, hk, **i32)
        self._slot = 0
        self._req_to_token = None
        self._bs = 0
        self._num_cols = cols
        self._wave_plan: list[tuple[int, int]] = []

    def _splits(self, bs: int, cols: int):
        """Span plan of the select schedule's split pass (as many programs as the first wave of the progressive one)."""
        return plan_splits(cols, bs * self.num_kv_heads, block_size=self.block_size, target_programs=self.wave_programs)

    def _waves(self, bs: int, cols: int) -> list[tuple[int, int]]:
        return plan_waves(self.config.ranked_chunk_ends(cols), bs * self.num_kv_heads,
                          target_programs=self.wave_programs, growth=self.wave_growth, max_waves=self.max_waves)

    def plan(self, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
             block_table: torch.Tensor, max_seq_len: int | None = None,
             epsilon: torch.Tensor | None = None, probe_epsilon: torch.Tensor | None = None) -> None:
        """Prepare one decode batch (copies into the ``_buf`` tensors; no host reads of device data).

        Args:
          req_to_token: ``[max_reqs, max_context_len]`` int32 on the device (kept by reference).
          req_pool_indices: ``[batch]``; seq_lens: ``[batch]`` tokens incl. the one being decoded.
          block_table: ``[batch, >= n_blocks]`` int32 logical block -> meta row (see
            :func:`flashinfer_ext.psa.block_meta.paged_block_table` / ``identity_block_table``).
          max_seq_len: optional host bound to narrow the sort width (eager mode only).
          epsilon: ``None`` (``config.epsilon`` for every row) or a ``[batch]`` fp32 device tensor of
            per-request thresholds; a row with ``epsilon >= 1`` attends all of its blocks (no cap).
          probe_epsilon: ``None`` (the rows' ``epsilon``) or a ``[batch]`` fp32 device tensor: the threshold whose
            stop point :attr:`probe_nread` reports (a row run at ``epsilon`` 1.0 with its real threshold here
            gets the exact result and what PSA would read at that threshold, in one pass).
        """
        bs = int(req_pool_indices.shape[0])
        if bs > self.max_batch_size:
            raise ValueError(f"batch {bs} exceeds max_batch_size={self.max_batch_size}")
        cfg, bsz = self.config, self.block_size
        self._req_to_token = req_to_token
        self._bs = bs
        cols = self.max_blocks_per_req
        if max_seq_len is not None:
            cols = max(1, min(cols, -(-int(max_seq_len) // bsz)))
        self._num_cols = cols
        self._wave_plan = self._waves(bs, cols) if bs and not self.select else []
        self._split_plan = self._splits(bs, cols) if bs and self.select else None
        need = bs * self.num_kv_heads * max((nc for _, nc in self._wave_plan), default=0) if not self.select else 0
        if need > self._partial_slots:
            raise ValueError(f"wave plan needs {need} partial slots > {self._partial_slots} allocated")
        self._req_pool_indices_buf[:bs].copy_(req_pool_indices, non_blocking=True)
        self._seq_lens_buf[:bs].copy_(seq_lens, non_blocking=True)
        eps = self._eps_buf[:bs]
        if epsilon is None:
            eps.fill_(cfg.epsilon)
        else:
            if epsilon.shape != (bs,):
                raise ValueError(f"epsilon must be a [{bs}] tensor, got shape {tuple(epsilon.shape)}")
            eps.copy_(epsilon, non_blocking=True)
        p_eps = self._probe_eps_buf[:bs]
        if probe_epsilon is None:
            p_eps.copy_(eps)
        else:
            if probe_epsilon.shape != (bs,):
                raise ValueError(f"probe_epsilon must be a [{bs}] tensor, got shape {tuple(probe_epsilon.shape)}")
            p_eps.copy_(probe_epsilon, non_blocking=True)
        w = min(block_table.shape[1], self.max_blocks_per_req)
        self._block_table_buf[:bs, :w].copy_(block_table[:, :w], non_blocking=True)
        sl = self._seq_lens_buf[:bs]
        torch.sub(sl, 1, out=self._start_buf[:bs])
        n_blocks = torch.div(sl + (bsz - 1), bsz, rounding_mode="floor")
        self._n_forced_buf[:bs].copy_(torch.clamp(n_blocks, max=cfg.sink_blocks + cfg.local_blocks))
        capped = torch.minimum(n_blocks, self._n_forced_buf[:bs] + cfg.max_blocks)
        limit = torch.where(eps >= 1.0, n_blocks, capped)
        self._list_lens_buf[:bs].copy_(limit.clamp(max=cols)[:, None].expand(bs, self.num_kv_heads))
        self._probe_lens_buf[:bs].copy_(torch.where(p_eps >= 1.0, n_blocks, capped).clamp(max=cols))

    def update_meta_decode(self, k_buffer: torch.Tensor, *meta: torch.Tensor) -> None:
        """Fold each request's newest key (position ``seq_len - 1``) into its block's metadata.

        ``k_buffer`` ``[num_slots, num_kv_heads, head_dim]`` and ``meta`` of one layer: ``kmin, kmax, kmean``
        ``[num_rows, num_kv_heads, head_dim]``, or for criticality 'sketch' ``codes, scales`` of a
        :class:`flashinfer_ext.psa.key_sketch.KeySketchPool`. Graph-capturable.
        """
        bs = self._bs
        fold = update_key_sketch if self.sketch else update_block_meta
        fold(k_buffer, *meta, self._req_to_token, self._req_pool_indices_buf[:bs], self._block_table_buf[:bs],
             self._start_buf[:bs], self._seq_lens_buf[:bs], block_size=self.block_size, max_new_blocks=1)

    def _views(self):
        bs, h, c = self._bs, self.num_kv_heads, self._num_cols
        n = bs * h * c
        return (self._scores_buf[:n].view(bs, h, c), self._keys_buf[:n].view(bs, h, c),
                self._sorted_keys_buf[:n].view(bs, h, c), self._order_buf[:n].view(bs, h, c))

    STAGES = ("criticality", "ranking", "suffix")

    def run(self, q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, *meta: torch.Tensor,
            stop_after: str | None = None, slot: int = 0):
        """One layer of PSA decode.

        ``stop_after`` (benchmarks only): return right after that stage of :attr:`STAGES` (the outputs are then
        not written), so the stages' time can be taken apart (``bench/psa_decode_bench.py --stage-profile``).

        Args:
          q: ``[batch, num_qo_heads, head_dim]`` post-RoPE queries.
          k_buffer, v_buffer: ``[num_slots, num_kv_heads, head_dim]`` bf16/fp16.
          meta: this layer's ``kmin, kmax, kmean`` ``[num_rows, num_kv_heads, head_dim]`` block metadata, or for
            criticality 'sketch' its ``codes, scales`` (:class:`flashinfer_ext.psa.key_sketch.KeySketchPool`).
          slot: where this run's :attr:`kept_est` and :attr:`probe_nread` go, in ``[0, stat_slots)`` (a layer
            index: the caller sums :attr:`kept_est_slots` / :attr:`probe_nread_slots` once per step instead of
            after every layer).

        Returns views into the wrapper's buffers (valid until the next run):
          ``o`` ``[batch, num_qo_heads, head_dim]``, ``lse`` ``[batch, num_qo_heads]`` fp32 base 2,
          ``nread`` ``[batch, num_kv_heads]`` int32 blocks in the result (incl. sink/local).
        """
        if stop_after is not None and stop_after not in self.STAGES:
            raise ValueError(f"stop_after={stop_after!r} must be None or one of {self.STAGES}")
        bs, cfg, hk, g, d = self._bs, self.config, self.num_kv_heads, self.group, self.head_dim
        self._slot = slot
        o, lse, nread, kept = self._o_buf[:bs], self._lse_buf[:bs], self._nread_buf[:bs], self.kept_est
        if bs == 0:
            return o, lse, nread
        scores, keys, sorted_keys, order = self._views()
        seq_lens, n_forced, list_lens = self._seq_lens_buf[:bs], self._n_forced_buf[:bs], self._list_lens_buf[:bs]
        if self.sketch:  # block masses from the int4 keys, then the group-max shares and each head's total
            mass = self._mass_buf[: bs * hk * g * self._num_cols].view(bs, hk, g, self._num_cols)
            sketch_block_mass(q, *meta, self._block_table_buf[:bs], seq_lens, mass, block_size=self.block_size,
                              sm_scale=self.sm_scale)
            if self.select:
                return self._run_select(q, k_buffer, v_buffer, mass, stop_after)
            sketch_shares(mass, seq_lens, scores, self._tot_buf[: bs * hk * g], block_size=self.block_size,
                          sink_blocks=cfg.sink_blocks, local_blocks=cfg.local_blocks, keys_out=keys)
        else:
            block_criticality(q, *meta, self._block_table_buf[:bs], seq_lens, scores,
                              block_size=self.block_size, sink_blocks=cfg.sink_blocks,
                              local_blocks=cfg.local_blocks, criticality=cfg.criticality,
                              group_reduce=cfg.group_reduce, keys_out=keys, rank_by=cfg.rank_by,
                              tile=self.crit_tile)
        if stop_after == "criticality":
            return o, lse, nread
        c = self._num_cols
        if self._prefix:  # exact top-K prefix + block-order tail (one Triton launch)
            rank_select(keys, order, self._select_scratch_buf,
                        prefix=max(16, min(self._prefix, 1 << (c - 1).bit_length())))
        else:
            rank_blocks(keys, sorted_keys, order)
        suffix = self._suffix_buf[: bs * hk * (c + 1)].view(bs, hk, c + 1)
        if stop_after == "ranking":
            return o, lse, nread
        if cfg.estimator != "paper":  # sketch: the scores are base-2 log shares, so the suffix is log2 sum 2^share
            bound_suffix(scores, suffix, sm_scale=math.log(2.0) if self.sketch else self.sm_scale,
                         block_size=1 if self.sketch else self.block_size, order=order,
                         tile=self.SUFFIX_TILE, tiles_buf=self._suffix_tiles_buf)
        if stop_after == "suffix":
            return o, lse, nread
        pairs = bs * hk
        wmax = max(nc for _, nc in self._wave_plan)
        partials = (self._po_buf[: pairs * wmax * g * d].view(pairs, wmax, g, d),
                    self._plse_buf[: pairs * wmax * g].view(pairs, wmax, g),
                    self._pmin_buf[: pairs * wmax * g].view(pairs, wmax, g),
                    self._pdmax_buf[: pairs * wmax * g].view(pairs, wmax, g))
        done = self._done_buf[:pairs]
        state = (self._st_acc_buf[: pairs * g * d].view(pairs, g, d), self._st_lse_buf[: pairs * g].view(pairs, g),
                 self._st_min_buf[: pairs * g].view(pairs, g), self._st_dmax_buf[: pairs * g].view(pairs, g), done)
        rpi = self._req_pool_indices_buf[:bs]
        probe = (self._probe_eps_buf[:bs], self._probe_lens_buf[:bs], self.probe_nread)
        for k, (chunk0, n_chunks) in enumerate(self._wave_plan):
            psa_chunk_attention(q, k_buffer, v_buffer, self._req_to_token, rpi, seq_lens, order, scores,
                                list_lens, n_forced, self._chunk_ends_buf, done, partials, chunk0=chunk0,
                                n_chunks=n_chunks, block_size=self.block_size, sm_scale=self.sm_scale,
                                check_done=k > 0, tile_tokens=self.tile_tokens)
            wave_merge(partials, state, o, lse, nread, kept, seq_lens, list_lens, n_forced, self._chunk_ends_buf,
                       self._eps_buf[:bs], suffix, probe, chunk0=chunk0, n_chunks=n_chunks, first=k == 0,
                       block_size=self.block_size, estimator=cfg.estimator, calib_slack=cfg.calib_slack,
                       totals=self._tot_buf[: bs * hk * g] if self.sketch else None)
        return o, lse, nread

    def _run_select(self, q, k_buffer, v_buffer, mass, stop_after):
        """Schedule 'select': the sketch's top-p lists (one launch), then one split pass over them (two launches)."""
        bs, cfg, hk, g = self._bs, self.config, self.num_kv_heads, self.group
        o, lse, nread, kept = self._o_buf[:bs], self._lse_buf[:bs], self._nread_buf[:bs], self.kept_est
        scores, _, _, lists = self._views()
        if stop_after == "criticality":
            return o, lse, nread
        sketch_select(mass, self._seq_lens_buf[:bs], self._eps_buf[:bs], self._list_lens_buf[:bs],
                      self._probe_eps_buf[:bs], self._probe_lens_buf[:bs], scores_out=scores, lists_out=lists,
                      list_lens_out=nread, probe_out=self.probe_nread, kept_out=kept,
                      totals_out=self._tot_buf[: bs * hk * g], block_size=self.block_size,
                      sink_blocks=cfg.sink_blocks, local_blocks=cfg.local_blocks, calib_slack=cfg.calib_slack)
        if stop_after is not None:
            return o, lse, nread
        plan = self._split_plan
        rows = bs * self.num_qo_heads
        po = self._split_o_buf[: rows * plan.num_splits * self.head_dim].view(rows, plan.num_splits, self.head_dim)
        plse = self._split_lse_buf[: rows * plan.num_splits].view(rows, plan.num_splits)
        sparse_decode_split(q, k_buffer, v_buffer, self._req_to_token, self._req_pool_indices_buf[:bs],
                            self._seq_lens_buf[:bs], lists, nread, plan, block_size=self.block_size,
                            sm_scale=self.sm_scale, partial_o_buf=po, partial_lse_buf=plse, out=o, lse_out=lse,
                            nread_out=nread)
        return o, lse, nread

    @property
    def order(self) -> torch.Tensor:
        """``[batch, num_kv_heads, num_cols]`` int64 rank order of the last :meth:`run` (a view)."""
        return self._views()[3]

    @property
    def sorted_scores(self) -> torch.Tensor:
        """``[batch, num_kv_heads, num_cols]`` fp32 criticality scores in the rank order of the last :meth:`run`
        (a new tensor: for tests and tools, not for the hot path)."""
        scores, _, _, order = self._views()
        return torch.gather(scores, 2, order)

    @property
    def kept_est(self) -> torch.Tensor:
        """``[batch, num_kv_heads]`` fp32: the estimator's kept mass at the stop point of the last :meth:`run`
        (smallest over the group's query heads; 1.0 for rows read fully)."""
        return self._kept_all_buf[self._slot, : self._bs]

    @property
    def kept_est_slots(self) -> torch.Tensor:
        """``[stat_slots, batch, num_kv_heads]`` fp32: :attr:`kept_est` of the last run into each slot."""
        return self._kept_all_buf[:, : self._bs]

    @property
    def probe_nread_slots(self) -> torch.Tensor:
        """``[stat_slots, batch, num_kv_heads]`` int32: :attr:`probe_nread` of the last run into each slot."""
        return self._probe_nread_all_buf[:, : self._bs]

    @property
    def probe_nread(self) -> torch.Tensor:
        """``[batch, num_kv_heads]`` int32: the blocks the stop test of the last :meth:`run` would have read at each
        row's ``probe_epsilon`` (equals ``nread`` where the probe threshold is the row's epsilon)."""
        return self._probe_nread_all_buf[self._slot, : self._bs]

    @property
    def waves(self) -> list[tuple[int, int]]:
        """Host wave plan ``[(first chunk, chunks), ...]`` of the current :meth:`plan`."""
        return list(self._wave_plan)
