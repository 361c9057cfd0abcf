"""Vertical line sums of several requests' observation rows in one launch pair (LoopServe Alg. 3 / Eq. 7), Triton.

Supports: a batch of ``num_reqs`` requests, one layer; each request has its own rows (observation
queries at distinct absolute positions, e.g. the last ``n_d`` decode queries or a prompt's last
window), stored contiguously in ``q_rows`` (request ``b``'s rows are ``qo_indptr[b]:qo_indptr[b+1]``,
requests in ascending order), and its keys at positions ``0..seq_lens[b]-1`` in SGLang's layout
``k_buffer [num_slots, num_kv_heads, head_dim]`` (post-RoPE) reached through
``req_to_token[req_pool_indices[b]]``; GQA (any group size); head_dim up to 256; bf16/fp16/fp32.
Each row attends causally (keys at positions ``<=`` its own).

Output ``v_sum [num_reqs, num_kv_heads, max_len]`` fp32: for request ``b`` and KV head ``h``, the
softmax attention of its rows summed over rows and the group's query heads, per key position:
exactly :func:`flashinfer_ext.loopserve.vs_estimate.vs_estimate`'s ``v_sum`` of that request alone (Eq. 7's
score), 0 at positions ``>= seq_lens[b]``. Only vertical sums: no slash sums, no maxima (top-B
selection needs none), so no atomics and a deterministic result.

Two launches: ``_batched_lse_kernel`` (grid ``[num_reqs, Hk, row blocks]``) then
``_batched_vsum_kernel`` (grid ``[num_reqs, Hk, key blocks of max_len]``, every output entry written:
no zero-fill). With ``num_splits > 1`` (long contexts, few requests: :func:`lse_splits`) the LSE pass is
``_batched_lse_split_kernel`` (grid ``[num_reqs, Hk, row blocks x spans]``: each program walks one span of
the keys) + ``_lse_merge_kernel``, three launches. The per-row LSE and per-block probabilities reuse the jit helpers of
:mod:`flashinfer_ext.loopserve.vs_estimate`. :func:`decode_topb_batched` (pure torch, one ``topk``) turns
``v_sum`` into per-request top-B lists.

Cautions:
  * row positions must be ``< seq_lens`` of their request and distinct; not checked (no host sync).
  * ``max_len`` (host int) sizes the output and the grid; it must be ``>= max(seq_lens)``; key blocks past a
    request's ``seq_lens`` only write zeros (a padded ``max_len`` costs launches, not key loads);
    ``max_qo_len`` (host int, optional) bounds the rows of one request (default: all rows, which
    launches idle programs).
  * a row block's key loop runs to the largest position in the block: rows sorted by position per
    request waste least work.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .vs_common import _load_q, _rows_lse, _scores, check_heads, launch_meta, target_programs_of
from .vs_lse_split import MAX_LSE_SPLITS, MIN_SPLIT_KEYS, _row_block, lse_splits, split_lse  # noqa: F401 (re-exported)

__all__ = ["vertical_sums_batched", "vertical_sums_batched_reference", "decode_topb_batched", "decode_topb_masks",
           "decode_topb_masked", "qo_indptr_of", "lse_splits", "vsum_key_blocks"]



@triton.jit
def _batched_lse_kernel(q_ptr, stride_qr, stride_qh, pos_ptr, indptr_ptr, k_ptr, stride_ks, stride_kh,
                        rtt_ptr, stride_rtt, rpi_ptr, lse_ptr, stride_lh, sm_scale_log2,
                        GROUP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                        HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, DOT_FP32: tl.constexpr):
    r0 = tl.program_id(2) * BLOCK_R
    start, n_rows, slots_ptr, q, g, r, rvalid, pos = _row_block(
        q_ptr, stride_qr, stride_qh, pos_ptr, indptr_ptr, rtt_ptr, stride_rtt, rpi_ptr, tl.program_id(0),
        tl.program_id(1), r0, GROUP, G_PAD, BLOCK_R, HEAD_DIM, D_PAD)
    if r0 < n_rows:
        h = tl.program_id(1)
        lse = _rows_lse(q, pos, k_ptr, stride_ks, stride_kh, h, slots_ptr, sm_scale_log2, G_PAD * BLOCK_R,
                        BLOCK_N, HEAD_DIM, D_PAD, DOT_FP32)
        tl.store(lse_ptr + (h * GROUP + g) * stride_lh + start + r, lse, mask=rvalid)


@triton.jit
def _block_vsum(q, pos, rvalid, lse, k_ptr, stride_ks, stride_kh, h, slot, kp, kvalid, sm_scale_log2,
                HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, DOT_FP32: tl.constexpr):
    """``[BLOCK_N]`` fp32: the normalised causal probabilities of the packed (query head, row) pairs on keys
    ``kp``, summed over all pairs at once (no per-group reshape: a layout shuffle per key block)."""
    s = _scores(q, k_ptr, stride_ks, stride_kh, h, slot, kvalid, sm_scale_log2, HEAD_DIM, D_PAD, DOT_FP32)
    ok = rvalid[:, None] & kvalid[None, :] & (kp[None, :] <= pos[:, None])
    return tl.sum(tl.where(ok, tl.exp2(s - lse[:, None]), 0.0), axis=0)


# the eager re-selection sizes its output by the batch's longest context: those arguments are not specialized, so a
# new length compiles no new binary (tests/flashinfer_ext/test_kernel_specialization.py)
@triton.jit(do_not_specialize=["max_len", "stride_ob", "stride_oh"])
def _batched_vsum_kernel(q_ptr, stride_qr, stride_qh, pos_ptr, indptr_ptr, k_ptr, stride_ks, stride_kh,
                         rtt_ptr, stride_rtt, rpi_ptr, seq_ptr, max_len, lse_ptr, stride_lh,
                         out_ptr, stride_ob, stride_oh, sm_scale_log2, key_blocks,
                         GROUP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                         HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, DOT_FP32: tl.constexpr,
                         ONE_ROW_BLOCK: tl.constexpr):
    """``key_blocks`` consecutive key blocks of one (request, KV head) per program. ``ONE_ROW_BLOCK`` (every
    request has at most ``BLOCK_R`` rows, as decode's n_d observation rows): the rows' queries and LSE are
    loaded once and the key loop carries only the key loads (pipelined across blocks)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    n_lo = tl.program_id(2) * (BLOCK_N * key_blocks)
    start = tl.load(indptr_ptr + b).to(tl.int64)
    n_rows = tl.load(indptr_ptr + b + 1).to(tl.int64) - start
    seq_len = tl.load(seq_ptr + b).to(tl.int64)
    slots_ptr = rtt_ptr + tl.load(rpi_ptr + b).to(tl.int64) * stride_rtt
    o_ptr = out_ptr + b * stride_ob + h * stride_oh
    if ONE_ROW_BLOCK:
        q, g, r, rvalid = _load_q(q_ptr + start * stride_qr, stride_qr, stride_qh, h, 0, n_rows, GROUP, G_PAD,
                                  BLOCK_R, HEAD_DIM, D_PAD)
        pos = tl.load(pos_ptr + start + r, mask=rvalid, other=-1).to(tl.int64)
        lse = tl.load(lse_ptr + (h * GROUP + g) * stride_lh + start + r, mask=rvalid, other=float("inf"))
        for kb in range(0, key_blocks):
            kp = n_lo + kb * BLOCK_N + tl.arange(0, BLOCK_N)
            kvalid = kp < seq_len
            if n_lo + kb * BLOCK_N < seq_len:
                slot = tl.load(slots_ptr + kp, mask=kvalid, other=0).to(tl.int64)
                v = _block_vsum(q, pos, rvalid, lse, k_ptr, stride_ks, stride_kh, h, slot, kp, kvalid,
                                sm_scale_log2, HEAD_DIM, D_PAD, DOT_FP32)
                tl.store(o_ptr + kp, v, mask=kp < max_len)
            else:  # a key block past the request's end (a padded width) only writes zeros, no key loads
                tl.store(o_ptr + kp, tl.zeros([BLOCK_N], tl.float32), mask=kp < max_len)
    else:
        for kb in range(0, key_blocks):
            n0 = n_lo + kb * BLOCK_N
            kp = n0 + tl.arange(0, BLOCK_N)
            kvalid = kp < seq_len
            slot = tl.load(slots_ptr + kp, mask=kvalid, other=0).to(tl.int64)
            v_acc = tl.zeros([BLOCK_N], tl.float32)
            n_iter = tl.where(n0 < seq_len, n_rows, 0)  # a key block past the request's end only writes zeros
            for r0 in range(0, n_iter, BLOCK_R):
                q, g, r, rvalid = _load_q(q_ptr + start * stride_qr, stride_qr, stride_qh, h, r0, n_rows, GROUP,
                                          G_PAD, BLOCK_R, HEAD_DIM, D_PAD)
                pos = tl.load(pos_ptr + start + r, mask=rvalid, other=-1).to(tl.int64)
                lse = tl.load(lse_ptr + (h * GROUP + g) * stride_lh + start + r, mask=rvalid, other=float("inf"))
                v_acc += _block_vsum(q, pos, rvalid, lse, k_ptr, stride_ks, stride_kh, h, slot, kp, kvalid,
                                     sm_scale_log2, HEAD_DIM, D_PAD, DOT_FP32)
            tl.store(o_ptr + kp, v_acc, mask=kp < max_len)


def qo_indptr_of(q_req: torch.Tensor, num_reqs: int) -> torch.Tensor:
    """``[num_reqs + 1]`` int32 row offsets of each request from ``q_req [R_total]`` (ascending request
    indices, rows of one request contiguous); on the device, no host sync."""
    bounds = torch.arange(num_reqs + 1, device=q_req.device, dtype=q_req.dtype)
    return torch.searchsorted(q_req.contiguous(), bounds).to(torch.int32)


def vertical_sums_batched(q_rows: torch.Tensor, q_pos: torch.Tensor, q_req: torch.Tensor, k_buffer: torch.Tensor,
                          req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                          max_len: int, *, sm_scale: float, out: torch.Tensor | None = None,
                          qo_indptr: torch.Tensor | None = None, max_qo_len: int | None = None,
                          lse_buf: torch.Tensor | None = None, block_r: int = 16, block_n: int = 64,
                          num_splits: int = 1, lse_part_buf: torch.Tensor | None = None,
                          key_blocks: int | None = None, target_programs: int | None = None,
                          split_len: int | None = None) -> torch.Tensor:
    """Per-request, per-KV-head vertical sums of the rows' causal softmax attention (module docstring).

    Args:
      q_rows: ``[R_total, num_qo_heads, head_dim]`` post-RoPE queries (bf16/fp16/fp32), last dim contiguous.
      q_pos: ``[R_total]`` int32/int64 absolute positions (distinct within a request, ``< seq_lens``).
      q_req: ``[R_total]`` int32/int64 request index of each row (ascending, rows of a request contiguous).
      k_buffer: ``[num_slots, num_kv_heads, head_dim]`` one layer's keys.
      req_to_token: ``[pool_size, max_context_len]`` int32 slot of each position, per pool row.
      req_pool_indices: ``[num_reqs]`` int pool row of each request.
      seq_lens: ``[num_reqs]`` int keys ``0..seq_lens[b]-1`` of request ``b`` are scored.
      max_len: host int ``>= max(seq_lens)``: sizes the output and the grid.
      sm_scale: softmax scale.
      out: optional preallocated ``[num_reqs, num_kv_heads, >= max_len]`` fp32 (last dim contiguous).
      qo_indptr: optional ``[num_reqs + 1]`` int32 row offsets (else computed from ``q_req`` on the device).
      max_qo_len: optional host bound on the rows of one request (sizes the first grid).
      lse_buf: optional preallocated ``[num_qo_heads, >= R_total]`` fp32 scratch (the rows' LSE).
      num_splits: host int >= 1: the LSE pass walks the keys in this many spans on separate programs and
        merges them (one more launch; :func:`lse_splits` picks it); 1 = one program walks all keys.
      lse_part_buf: optional preallocated ``[2, >= num_splits, num_qo_heads, >= R_total]`` fp32 scratch of
        the spans' running maxima / sums (``num_splits > 1`` only).
      split_len: host int, a multiple of ``block_n`` (overrides ``num_splits``): the LSE pass always walks
        the keys in spans of exactly this many keys (``cdiv(max_len, split_len)`` spans, then the merge). The
        rows' LSE then does not depend on ``max_len``: spans past a request's keys add exactly nothing, so a
        call padded to a longer ``max_len`` (a CUDA graph's static width) gives the same bits.
      key_blocks: host int >= 1: consecutive ``block_n``-key blocks per program of the sums pass (default
        :func:`vsum_key_blocks` of ``target_programs``, host ints; default
        :func:`~flashinfer_ext.loopserve.vs_estimate.target_programs_of` the device: about 2 x the SM count).
    Returns ``v_sum [num_reqs, num_kv_heads, max_len]`` fp32 (a view of ``out`` if given). Two launches
    (three with ``num_splits > 1``), no host sync.
    """
    r_total, hq, d = q_rows.shape
    hk = k_buffer.shape[1]
    n_req = req_pool_indices.shape[0]
    group = check_heads(hq, hk, d)
    if q_pos.shape != (r_total,) or q_req.shape != (r_total,):
        raise ValueError(f"q_pos / q_req have shapes {tuple(q_pos.shape)} / {tuple(q_req.shape)}, "
                         f"expected ({r_total},)")
    if seq_lens.shape != (n_req,):
        raise ValueError(f"seq_lens has shape {tuple(seq_lens.shape)}, expected ({n_req},)")
    if out is None:
        out = torch.empty(n_req, hk, max_len, dtype=torch.float32, device=q_rows.device)
    elif out.dtype != torch.float32 or out.shape[:2] != (n_req, hk) or out.shape[2] < max_len or out.stride(2) != 1:
        raise ValueError(f"out must be [{n_req}, {hk}, >= {max_len}] fp32 with a contiguous last dim")
    out = out[:, :, :max_len]
    if n_req == 0 or max_len == 0:
        return out
    if r_total == 0:
        return out.zero_()
    assert q_rows.stride(2) == 1 and k_buffer.stride(2) == 1 and req_to_token.stride(1) == 1
    if qo_indptr is None:
        qo_indptr = qo_indptr_of(q_req, n_req)
    meta = launch_meta(group, d, block_r, block_n)
    scale = float(sm_scale) / math.log(2.0)
    lse = lse_buf if lse_buf is not None else torch.empty(hq, r_total, dtype=torch.float32, device=q_rows.device)
    if lse.dtype != torch.float32 or lse.shape[0] != hq or lse.shape[1] < r_total or lse.stride(1) != 1:
        raise ValueError(f"lse_buf must be [{hq}, >= {r_total}] fp32 with a contiguous last dim")
    q_pos = q_pos.contiguous()
    rows = r_total if max_qo_len is None else max(min(max_qo_len, r_total), 1)
    row_blocks = triton.cdiv(rows, meta["BLOCK_R"])
    if num_splits < 1:
        raise ValueError(f"num_splits={num_splits} is out of range: expected an integer >= 1")
    fixed = split_len is not None
    if fixed and (split_len < block_n or split_len % block_n):
        raise ValueError(f"split_len={split_len} is out of range: expected a positive multiple of block_n={block_n}")
    if not fixed:
        split_len = triton.cdiv(triton.cdiv(max_len, num_splits), block_n) * block_n
    num_splits = triton.cdiv(max_len, split_len)  # spans of whole key blocks; never an empty one
    if num_splits == 1 and not fixed:
        _batched_lse_kernel[(n_req, hk, row_blocks)](
            q_rows, q_rows.stride(0), q_rows.stride(1), q_pos, qo_indptr, k_buffer, k_buffer.stride(0),
            k_buffer.stride(1), req_to_token, req_to_token.stride(0), req_pool_indices, lse, lse.stride(0), scale,
            **meta)
    else:
        split_lse(q_rows, q_pos, qo_indptr, k_buffer, req_to_token, req_pool_indices, lse, scale, num_splits,
                  split_len, row_blocks, meta, lse_part_buf)
    n_blocks = triton.cdiv(max_len, block_n)
    if key_blocks is None:
        key_blocks = vsum_key_blocks(n_req * hk * n_blocks, target_programs or target_programs_of(q_rows.device))
    if key_blocks < 1:
        raise ValueError(f"key_blocks={key_blocks} is out of range: expected an integer >= 1")
    _batched_vsum_kernel[(n_req, hk, triton.cdiv(n_blocks, key_blocks))](
        q_rows, q_rows.stride(0), q_rows.stride(1), q_pos, qo_indptr, k_buffer, k_buffer.stride(0),
        k_buffer.stride(1), req_to_token, req_to_token.stride(0), req_pool_indices, seq_lens, max_len,
        lse, lse.stride(0), out, out.stride(0), out.stride(1), scale, key_blocks, **meta,
        ONE_ROW_BLOCK=rows <= meta["BLOCK_R"])
    return out


def vsum_key_blocks(total_blocks: int, target_programs: int) -> int:
    """Key blocks per program of the sums pass: one program per (request, KV head, 64 keys) at 8 x 32k keys is
    32768 programs of one dependent slot -> key -> dot chain each (H100: 25 ms a 32-layer step, more than the
    whole LSE pass); grouping blocks so that ~4 waves of ``target_programs`` remain lets each program pipeline
    its key loads. A power of two, at most 16, 1 for small grids."""
    want = min(total_blocks // max(4 * target_programs, 1), 16)
    return 1 if want < 2 else 1 << (int(want).bit_length() - 1)


def vertical_sums_batched_reference(q_rows: torch.Tensor, q_pos: torch.Tensor, q_req: torch.Tensor,
                                    k_buffer: torch.Tensor, req_to_token: torch.Tensor,
                                    req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, max_len: int, *,
                                    sm_scale: float) -> torch.Tensor:
    """fp32 torch reference of :func:`vertical_sums_batched` (same arguments and result; one
    :func:`flashinfer_ext.loopserve.reference.vs_estimate_reference` per request: reads host values)."""
    from .reference import vs_estimate_reference

    n_req, hk = req_pool_indices.shape[0], k_buffer.shape[1]
    out = torch.zeros(n_req, hk, max_len, dtype=torch.float32, device=q_rows.device)
    req = q_req.long().cpu()
    for b in range(n_req):
        rows = torch.nonzero(req == b).flatten().to(q_rows.device)
        n = int(seq_lens[b])
        if rows.numel() == 0 or n == 0:
            continue
        slots = req_to_token[int(req_pool_indices[b])]
        v_sum = vs_estimate_reference(q_rows[rows], q_pos[rows].cpu(), k_buffer, slots, n, sm_scale)[0]
        out[b, :, :n] = v_sum.to(out.device)
    return out


def decode_topb_masks(budgets: torch.Tensor, seq_lens: torch.Tensor, n: int,
                      width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-request masks of :func:`decode_topb_batched` for scores ``[num_reqs, Hk, n]``: ``(excluded
    [num_reqs, 1, n] bool: positions >= seq_lens, valid [num_reqs, 1, width] bool: the first
    min(budget, seq_len) ranks)``. The same for every layer of a decode step: planned once per step."""
    if not 0 < width <= n:
        raise ValueError(f"width={width} is out of range: expected an integer in [1, {n}]")
    dev = budgets.device
    seq = seq_lens.to(dev).long()
    excluded = (torch.arange(n, device=dev)[None, :] >= seq[:, None])[:, None, :]
    keep = torch.minimum(budgets.to(dev).long(), seq)
    return excluded, (torch.arange(width, device=dev)[None, :] < keep[:, None])[:, None, :]


def decode_topb_masked(v_sum: torch.Tensor, excluded: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """:func:`decode_topb_batched` with its masks (:func:`decode_topb_masks`) given: ``v_sum [num_reqs, Hk, n]``
    fp32 -> ``lists [num_reqs, Hk, width]`` int32 (one masked fill, one ``topk``, one select)."""
    top = torch.topk(v_sum.masked_fill(excluded, float("-inf")), valid.shape[2], dim=2, sorted=True).indices
    return torch.where(valid, top, -1).to(torch.int32)


def decode_topb_batched(v_sum: torch.Tensor, budgets: torch.Tensor, seq_lens: torch.Tensor,
                        width: int) -> torch.Tensor:
    """Top-``min(budget, seq_len)`` key positions per request and KV head (LoopServe Alg. 3 / Eq. 7), batched.

    Args:
      v_sum: ``[num_reqs, num_kv_heads, N]`` fp32 scores (:func:`vertical_sums_batched`).
      budgets: ``[num_reqs]`` int top-B budget of each request (>= 1).
      seq_lens: ``[num_reqs]`` int positions ``>= seq_lens[b]`` are never selected.
      width: host int ``>= max_b min(budgets[b], seq_lens[b])`` and ``<= N`` (planned on the host).
    Returns ``lists [num_reqs, num_kv_heads, width]`` int32: request ``b``'s first
    ``min(budgets[b], seq_lens[b])`` entries are its top positions in descending score order (as a
    set, :func:`flashinfer_ext.loopserve.vs_select.decode_topb`'s), the rest ``-1``. One ``topk``, no host sync;
    ties break arbitrarily.
    """
    excluded, valid = decode_topb_masks(budgets.to(v_sum.device), seq_lens, v_sum.shape[2], width)
    return decode_topb_masked(v_sum, excluded, valid)
