"""PSA decode, split-K over the ranked block list: chunk partials and the host wave plan.

Supports: one decode query per request, GQA (a KV head's whole query-head group in one
program), SGLang's KV layout ``[num_slots, num_kv_heads, head_dim]`` reached through
``req_to_token``, block sizes 1..128 (powers of two), head_dim <= 256, bf16/fp16 KV,
partial last blocks. The ranked list of a (request, KV head) is cut into *chunks*:
chunk 0 = the forced blocks (ranks ``[0, n_forced)``: sink + local), chunk ``j >= 1`` =
ranks ``[n_forced + E[j-1], n_forced + E[j])`` with ``E`` =
:meth:`flashinfer_ext.psa.config.PsaDecodeConfig.ranked_chunk_ends` (``E[0] = 0`` prepended),
clipped to the pair's list length. One launch (:func:`psa_chunk_attention`) attends a
contiguous range of chunks, one program per (request, KV head, chunk), and writes per
chunk and query head: the normalised partial output ``o``, its BASE-2 ``lse``, the
smallest base-2 mass of a full ranked block (PSA's AS_min) and the largest
``log2(block mass) - log2(block bound)`` of its ranked blocks (the tightness of the
cuboid bound, used by the 'calibrated' estimator). Programs of a pair already marked
done (device flag written by :mod:`flashinfer_ext.psa.wave_merge`) attend nothing.

:func:`plan_waves` groups the chunks into *waves* (launches) on the host: the first wave
fills the GPU (``target_programs`` programs), each next wave covers about ``growth`` times
the ranks read so far, the last takes the rest. Waves change only what is read past the
stop point (wasted bandwidth), never the result: the stop test runs chunk by chunk.

Cautions: a wave reads all of its chunks for every pair not done when it starts, so up to
``growth``x the needed blocks can be read (the result only uses the chunks up to the stop).
Partials are fp32 and sized by the largest wave (see the wrapper's ``_buf`` tensors).
Under the CPU interpreter ``tl.dot`` is emulated in fp32 (the interpreter mis-computes bf16 dots).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from flashinfer_ext.common.tile_attention import attend_slots, group_query_state, list_tile_slots

__all__ = ["psa_chunk_attention", "plan_waves"]


@triton.jit
def _chunk_kernel(
    q_ptr, stride_qb, stride_qh,
    k_ptr, stride_k_slot, stride_k_head, v_ptr, stride_v_slot, stride_v_head,
    rtt_ptr, stride_rtt, rpi_ptr, seq_lens_ptr,
    order_ptr, scores_ptr, stride_ob, stride_oh, list_lens_ptr, n_forced_ptr, ends_ptr, done_ptr,
    po_ptr, plse_ptr, pmin_ptr, pdmax_ptr, wmax,
    chunk0, n_chunks, sm_scale_log2, log2_block,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, SUB: tl.constexpr,
    CHECK_DONE: tl.constexpr, DOT_FP32: tl.constexpr,
):
    pid = tl.program_id(0)
    pair = pid // n_chunks
    ci = pid % n_chunks
    r = pair // NUM_KV_HEADS
    h = pair % NUM_KV_HEADS
    r64 = r.to(tl.int64)
    j = chunk0 + ci
    seq_len = tl.load(seq_lens_ptr + r)
    list_len = tl.load(list_lens_ptr + pair)
    nf = tl.minimum(tl.load(n_forced_ptr + r), list_len)
    e_prev = tl.load(ends_ptr + tl.maximum(j - 1, 0))
    lo = tl.where(j == 0, 0, nf + e_prev)
    hi = tl.minimum(nf + tl.load(ends_ptr + j), list_len)
    if CHECK_DONE:
        hi = tl.where(tl.load(done_ptr + pair) != 0, lo, hi)
    active = lo < hi

    if active:  # chunks past the list end, or of pairs already done, do nothing at all
        rpi = tl.load(rpi_ptr + r).to(tl.int64)
        rtt_row = rtt_ptr + rpi * stride_rtt
        order_row = order_ptr + r64 * stride_ob + h * stride_oh
        scores_row = scores_ptr + r64 * stride_ob + h * stride_oh
        q, g, d, gmask, dmask, m_i, l_i, acc = group_query_state(q_ptr, stride_qb, stride_qh, r64, h, k_ptr,
                                                                 GROUP, G_PAD, HEAD_DIM, D_PAD)
        lmin = tl.full([G_PAD], float("inf"), tl.float32)
        dmax = tl.full([G_PAD], float("-inf"), tl.float32)
        TOK: tl.constexpr = SUB * BLOCK_SIZE
        tok = tl.arange(0, TOK)
        for t0 in range(lo, hi, SUB):
            slot, tvalid = list_tile_slots(order_row, rtt_row, t0, hi, seq_len, tok, BLOCK_SIZE)
            m_i, m_safe, l_i, acc, p = attend_slots(q, k_ptr, v_ptr, stride_k_slot, stride_k_head, stride_v_slot,
                                                    stride_v_head, h, slot, tvalid, tvalid[None, :], d, dmask, m_i,
                                                    l_i, acc, sm_scale_log2, DOT_FP32)
            # per ranked block: AS_min over full blocks, bound tightness over all ranked blocks
            ranks = t0 + tl.arange(0, SUB)
            in_rank = (ranks < hi) & (ranks >= nf)
            lb = tl.load(order_row + ranks, mask=ranks < hi, other=0).to(tl.int64)
            full = in_rank & ((lb + 1) * BLOCK_SIZE <= seq_len)
            pb = tl.sum(tl.reshape(p, (G_PAD, SUB, BLOCK_SIZE)), axis=2)  # [G_PAD, SUB]
            lm = tl.log2(tl.maximum(pb, 1e-30)) + m_safe[:, None]
            lmin = tl.minimum(lmin, tl.min(tl.where(full[None, :], lm, float("inf")), axis=1))
            bnd = tl.load(scores_row + lb, mask=in_rank, other=0.0) * sm_scale_log2 + log2_block
            dmax = tl.maximum(dmax, tl.max(tl.where(in_rank[None, :], lm - bnd[None, :], float("-inf")), axis=1))

        has = l_i > 0.0
        l_safe = tl.where(has, l_i, 1.0)
        o = acc / l_safe[:, None]
        lse = tl.where(has, m_i + tl.log2(l_safe), float("-inf"))
        base = pair.to(tl.int64) * wmax + ci
        gm = gmask
        tl.store(po_ptr + (base * GROUP + g)[:, None] * HEAD_DIM + d[None, :], o, mask=gm[:, None] & dmask[None, :])
        tl.store(plse_ptr + base * GROUP + g, lse, mask=gm)
        tl.store(pmin_ptr + base * GROUP + g, lmin, mask=gm)
        tl.store(pdmax_ptr + base * GROUP + g, dmax, mask=gm)


def psa_chunk_attention(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, order, scores,
                        list_lens, n_forced, chunk_ends, done, partials, *, chunk0: int, n_chunks: int,
                        block_size: int, sm_scale: float, check_done: bool, tile_tokens: int = 64) -> None:
    """Attend chunks ``[chunk0, chunk0 + n_chunks)`` of every (request, KV head); one launch.

    Args:
      q: ``[batch, num_qo_heads, head_dim]``; k_buffer, v_buffer: ``[num_slots, num_kv_heads, head_dim]``.
      req_to_token: ``[max_reqs, max_context_len]`` int32; req_pool_indices, seq_lens: ``[batch]`` int32.
      order: ``[batch, num_kv_heads, num_cols]`` int64 rank -> logical block; scores: same shape
        and strides, fp32 criticality scores in block order.
      list_lens: ``[batch, num_kv_heads]`` int32 (contiguous) ranks that may be read; n_forced: ``[batch]`` int32.
      chunk_ends: int32 device ``[>= chunk0 + n_chunks]`` = ``[0] + ranked_chunk_ends(...)``.
      done: ``[batch, num_kv_heads]`` int32 (read only when ``check_done``).
      partials: ``(o [P, W, G, D] fp32, lse [P, W, G], as_min [P, W, G], dmax [P, W, G])`` with
        ``P >= batch * num_kv_heads`` pairs and ``W >= n_chunks``; chunk ``chunk0 + i`` goes to slot ``i``.
    """
    batch, num_qo_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    group = num_qo_heads // num_kv_heads
    if batch == 0 or n_chunks == 0:
        return
    po, plse, pmin, pdmax = partials
    assert q.stride(2) == 1 and k_buffer.stride(2) == 1 and v_buffer.stride(2) == 1
    assert order.stride() == scores.stride() and order.stride(2) == 1 and list_lens.is_contiguous()
    assert po.shape[1] >= n_chunks and po.shape[2] == group and po.shape[3] == head_dim
    sub = max(1, triton.next_power_of_2(max(tile_tokens, 16)) // block_size)
    _chunk_kernel[(batch * num_kv_heads * n_chunks,)](
        q, q.stride(0), q.stride(1),
        k_buffer, k_buffer.stride(0), k_buffer.stride(1), v_buffer, v_buffer.stride(0), v_buffer.stride(1),
        req_to_token, req_to_token.stride(0), req_pool_indices, seq_lens,
        order, scores, order.stride(0), order.stride(1), list_lens, n_forced, chunk_ends, done,
        po, plse, pmin, pdmax, po.shape[1],
        chunk0, n_chunks, float(sm_scale) / math.log(2.0), math.log2(block_size),
        NUM_KV_HEADS=num_kv_heads, GROUP=group, G_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, D_PAD=max(16, triton.next_power_of_2(head_dim)), BLOCK_SIZE=block_size,
        SUB=sub, CHECK_DONE=check_done, DOT_FP32=os.environ.get("TRITON_INTERPRET", "0") == "1",
    )


def plan_waves(chunk_ends: list[int], pairs: int, *, target_programs: int, growth: float = 2.0,
               max_waves: int = 12, first_min_chunks: int = 2) -> list[tuple[int, int]]:
    """Host wave plan: ``[(chunk0, n_chunks), ...]`` covering chunks ``0 .. len(chunk_ends)``.

    ``chunk_ends`` = ``ranked_chunk_ends(n_ranked)`` (without the leading 0); chunk 0 is the
    forced chunk. Wave 0 holds at least ``target_programs / pairs`` chunks; each next wave ends at
    the first chunk whose rank end is >= ``growth`` x the previous wave's rank end; at most
    ``max_waves`` waves (the last takes the rest). Depends only on host ints: same plan, same launches.
    """
    total = 1 + len(chunk_ends)
    first = min(total, max(first_min_chunks, -(-target_programs // max(pairs, 1))))
    waves = [(0, first)]
    c = first
    while c < total:
        if len(waves) == max_waves - 1:
            waves.append((c, total - c))
            break
        target = growth * chunk_ends[c - 2] if c >= 2 else chunk_ends[0]
        e = c  # last chunk of this wave
        while e < total - 1 and chunk_ends[e - 1] < target:
            e += 1
        waves.append((c, e - c + 1))
        c = e + 1
    return waves
