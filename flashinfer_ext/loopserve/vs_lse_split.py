"""The key-split log-sum-exp pass of the line estimators: each (request, KV head, row block) walks its keys in
``num_splits`` spans on separate programs (running max / sum per span), then one merge launch. Used by
:func:`flashinfer_ext.loopserve.vs_estimate.vs_estimate` and :func:`flashinfer_ext.loopserve.vs_estimate_batched.vertical_sums_batched`
on long contexts, where one program per row block walking every key is latency-bound.

Supports what the estimators support (:mod:`flashinfer_ext.loopserve.vs_common`). Cautions: ``split_len`` must be a multiple
of the launch's ``BLOCK_N``; a row without keys gets ``+inf`` as in ``_rows_lse``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .vs_common import _load_q, _rows_ml

__all__ = ["split_lse", "lse_splits", "MAX_LSE_SPLITS", "MIN_SPLIT_KEYS"]

# the key-split LSE (lse_splits): at most this many spans, each at least MIN_SPLIT_KEYS keys (shorter walks are
# latency-cheap already, and the merge launch would cost more than it saves)
MAX_LSE_SPLITS = 32
MIN_SPLIT_KEYS = 4096


@triton.jit
def _row_block(q_ptr, stride_qr, stride_qh, pos_ptr, indptr_ptr, rtt_ptr, stride_rtt, rpi_ptr, b, h, r0,
               GROUP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_R: tl.constexpr, HEAD_DIM: tl.constexpr,
               D_PAD: tl.constexpr):
    """Request ``b``'s rows ``r0..r0+BLOCK_R-1`` for KV head ``h`` (packed as ``_load_q``; masked past its
    rows): ``(start, n_rows, slots_ptr, q, g, r, rvalid, pos)``."""
    start = tl.load(indptr_ptr + b).to(tl.int64)
    n_rows = tl.load(indptr_ptr + b + 1).to(tl.int64) - start
    slots_ptr = rtt_ptr + tl.load(rpi_ptr + b).to(tl.int64) * stride_rtt
    q, g, r, rvalid = _load_q(q_ptr + start * stride_qr, stride_qr, stride_qh, h, r0, n_rows, GROUP, G_PAD,
                              BLOCK_R, HEAD_DIM, D_PAD)
    pos = tl.load(pos_ptr + start + r, mask=rvalid, other=-1).to(tl.int64)
    return start, n_rows, slots_ptr, q, g, r, rvalid, pos


@triton.jit
def _batched_lse_split_kernel(q_ptr, stride_qr, stride_qh, pos_ptr, indptr_ptr, k_ptr, stride_ks, stride_kh,
                              rtt_ptr, stride_rtt, rpi_ptr, part_ptr, stride_pp, stride_ps, stride_ph, sm_scale_log2,
                              num_splits, split_len,
                              GROUP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_R: tl.constexpr,
                              BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                              DOT_FP32: tl.constexpr):
    """One key span ``[sp * split_len, (sp + 1) * split_len)`` of a row block's LSE: the running max / sum
    into ``part [2, num_splits, Hq, R_total]`` (merged by ``_lse_merge_kernel``)."""
    h = tl.program_id(1)
    r0 = (tl.program_id(2) // num_splits) * BLOCK_R
    sp = tl.program_id(2) % num_splits
    start, n_rows, slots_ptr, q, g, r, rvalid, pos = _row_block(
        q_ptr, stride_qr, stride_qh, pos_ptr, indptr_ptr, rtt_ptr, stride_rtt, rpi_ptr, tl.program_id(0), h, r0,
        GROUP, G_PAD, BLOCK_R, HEAD_DIM, D_PAD)
    if r0 < n_rows:
        k_lo = sp.to(tl.int64) * split_len
        m_i, l_i = _rows_ml(q, pos, k_ptr, stride_ks, stride_kh, h, slots_ptr, sm_scale_log2, k_lo, k_lo + split_len,
                            G_PAD * BLOCK_R, BLOCK_N, HEAD_DIM, D_PAD, DOT_FP32)
        off = sp * stride_ps + (h * GROUP + g) * stride_ph + start + r
        tl.store(part_ptr + off, m_i, mask=rvalid)
        tl.store(part_ptr + stride_pp + off, l_i, mask=rvalid)


@triton.jit
def _lse_merge_kernel(part_ptr, stride_pp, stride_ps, stride_ph, lse_ptr, stride_lh, r_total, num_splits,
                      BLOCK: tl.constexpr):
    """``lse [Hq, R_total]`` (base 2; ``+inf`` for a row without keys, as ``_rows_lse``) from the spans'
    running maxima / sums."""
    hq = tl.program_id(0)
    r = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = r < r_total
    base = part_ptr + hq * stride_ph + r
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    for sp in range(0, num_splits):
        m = tl.maximum(m, tl.load(base + sp * stride_ps, mask=ok, other=float("-inf")))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    l_tot = tl.zeros([BLOCK], tl.float32)
    for sp in range(0, num_splits):
        m_s = tl.load(base + sp * stride_ps, mask=ok, other=float("-inf"))
        l_tot += tl.load(base + stride_pp + sp * stride_ps, mask=ok, other=0.0) * tl.exp2(m_s - m_safe)
    lse = tl.where(l_tot > 0, m + tl.log2(tl.maximum(l_tot, 1e-30)), float("inf"))
    tl.store(lse_ptr + hq * stride_lh + r, lse, mask=ok)


def split_lse(q_rows, q_pos, qo_indptr, k_buffer, req_to_token, req_pool_indices, lse, scale, num_splits, split_len,
              row_blocks, meta, lse_part_buf=None) -> None:
    """The LSE pass in ``num_splits`` key spans of ``split_len`` keys (a multiple of ``BLOCK_N``) + the merge
    into ``lse [Hq, >= R_total]`` fp32: two launches. Arguments as :func:`vertical_sums_batched`'s (``scale``
    base 2, ``meta`` :func:`~flashinfer_ext.loopserve.vs_estimate.launch_meta`); shared with the single-request
    :func:`~flashinfer_ext.loopserve.vs_estimate.vs_estimate`."""
    r_total, hq, _ = q_rows.shape
    n_req, hk = req_pool_indices.shape[0], k_buffer.shape[1]
    part = lse_part_buf if lse_part_buf is not None else \
        torch.empty(2, num_splits, hq, r_total, dtype=torch.float32, device=q_rows.device)
    if part.dtype != torch.float32 or part.dim() != 4 or part.shape[0] != 2 or part.shape[1] < num_splits \
            or part.shape[2] != hq or part.shape[3] < r_total or part.stride(3) != 1:
        raise ValueError(f"lse_part_buf must be [2, >= {num_splits}, {hq}, >= {r_total}] fp32 with a contiguous "
                         "last dim")
    _batched_lse_split_kernel[(n_req, hk, row_blocks * num_splits)](
        q_rows, q_rows.stride(0), q_rows.stride(1), q_pos, qo_indptr, k_buffer, k_buffer.stride(0),
        k_buffer.stride(1), req_to_token, req_to_token.stride(0), req_pool_indices, part, part.stride(0),
        part.stride(1), part.stride(2), scale, num_splits, split_len, **meta)
    _lse_merge_kernel[(hq, triton.cdiv(r_total, 128))](
        part, part.stride(0), part.stride(1), part.stride(2), lse, lse.stride(0), r_total, num_splits, BLOCK=128)


def lse_splits(num_reqs: int, num_kv_heads: int, row_blocks: int, max_len: int, target_programs: int,
               min_split_keys: int = MIN_SPLIT_KEYS) -> int:
    """Key spans for :func:`vertical_sums_batched`'s LSE pass (host ints only): enough that
    ``num_reqs * num_kv_heads * row_blocks * spans`` programs reach ``target_programs`` (about two waves),
    a power of two, each span at least ``min_split_keys`` keys, at most ``MAX_LSE_SPLITS``. One program per
    (request, KV head, row block) walks every key otherwise: at 8 requests x 32k keys on an H100 that is 64
    programs of 512 serial key blocks, a latency-bound pass that dominated a re-selecting decode step."""
    programs = max(num_reqs * num_kv_heads * row_blocks, 1)
    want = min(-(-target_programs // programs), max_len // max(min_split_keys, 1), MAX_LSE_SPLITS)
    return 1 if want < 2 else 1 << (int(want).bit_length() - 1)
