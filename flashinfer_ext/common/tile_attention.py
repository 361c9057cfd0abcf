"""One tile of list-driven decode attention, shared by the Triton decode kernels (``@triton.jit`` helpers).

Supports: a tile of ``TOK = SUB * BLOCK_SIZE`` key positions taken from a per-(request, KV head) list of
logical blocks (:func:`list_tile_slots`), SGLang's KV layout ``[num_slots, num_kv_heads, head_dim]`` reached
through a ``req_to_token`` row, one decode query per request with its GQA group ``[G_PAD, D_PAD]``, and the
base-2 online-softmax update of a running ``(m, l, acc)`` state over any query rows and score mask
(:func:`attend_slots`). Used by :mod:`flashinfer_ext.common.sparse_decode`, :mod:`flashinfer_ext.common.split_decode`,
:mod:`flashinfer_ext.psa.chunks` and (the update only) :mod:`flashinfer_ext.loopserve.vs_prefill`.

Cautions: scores are base 2 (``sm_scale_log2 = sm_scale / ln 2``); masked positions score ``-inf``; a tile with
no valid position leaves the state unchanged (``m_safe`` guards ``-inf - -inf``). ``DOT_FP32`` emulates the
dots in fp32 (the Triton CPU interpreter mis-computes bf16 ``tl.dot``).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["group_query_state", "list_tile_slots", "attend_slots"]


@triton.jit
def group_query_state(q_ptr, stride_qb, stride_qh, r64, h, k_ptr, GROUP: tl.constexpr, G_PAD: tl.constexpr,
                      HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
    """The query rows of KV head ``h``'s group for request ``r64`` (``[G_PAD, D_PAD]`` in the KV dtype) and an
    empty online-softmax state. Returns ``(q, g, d, gmask, dmask, m_i, l_i, acc)``."""
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    gmask = g < GROUP
    dmask = d < HEAD_DIM
    q = tl.load(q_ptr + r64 * stride_qb + (h * GROUP + g)[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0).to(k_ptr.dtype.element_ty)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    return q, g, d, gmask, dmask, m_i, l_i, acc


@triton.jit
def list_tile_slots(list_row_ptr, rtt_row_ptr, t0, t_hi, seq_len, tok, BLOCK_SIZE: tl.constexpr):
    """Slots ``[TOK]`` int64 and validity ``[TOK]`` of list ranks ``[t0, t0 + TOK // BLOCK_SIZE)`` (ranks
    ``>= t_hi`` and positions ``>= seq_len`` invalid); ``tok = tl.arange(0, TOK)``."""
    rank_tok = t0 + tok // BLOCK_SIZE
    lb = tl.load(list_row_ptr + rank_tok, mask=rank_tok < t_hi, other=0).to(tl.int64)
    pos = lb * BLOCK_SIZE + tok % BLOCK_SIZE
    tvalid = (rank_tok < t_hi) & (pos < seq_len)
    slot = tl.load(rtt_row_ptr + pos, mask=tvalid, other=0).to(tl.int64)
    return slot, tvalid


@triton.jit
def attend_slots(q, k_ptr, v_ptr, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head, h, slot, tvalid,
                 ok, d, dmask, m_i, l_i, acc, sm_scale_log2, DOT_FP32: tl.constexpr):
    """Online-softmax update of ``(m_i [ROWS], l_i [ROWS], acc [ROWS, D_PAD])`` for query rows ``q [ROWS, D_PAD]``
    by the keys / values at ``slot [TOK]`` of KV head ``h``: ``tvalid [TOK]`` masks the loads, ``ok`` (broadcast
    to ``[ROWS, TOK]``: ``tvalid[None, :]`` for decode, a causal / line mask for prefill) the scores. Returns
    ``(m_new, m_safe, l_i, acc, p)``: ``p [ROWS, TOK]`` the tile's probabilities relative to ``m_safe`` (callers
    that track block masses read it)."""
    kv_mask = tvalid[:, None] & dmask[None, :]
    k = tl.load(k_ptr + slot[:, None] * stride_k_slot + h * stride_k_head + d[None, :], mask=kv_mask, other=0.0)
    if DOT_FP32:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)))
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(ok, s * sm_scale_log2, float("-inf"))  # [ROWS, TOK] base-2 scores
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_ptr + slot[:, None] * stride_v_slot + h * stride_v_head + d[None, :], mask=kv_mask, other=0.0)
    if DOT_FP32:
        pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32))
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return m_new, m_safe, l_i, acc, p
