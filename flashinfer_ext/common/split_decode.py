"""Split-list sparse decode: the plain sparse-page decode over per-(request, KV head) lists, with each list
cut into spans that separate programs attend, then one merge.

Supports: what :func:`flashinfer_ext.common.sparse_decode.sparse_decode` supports with ``epsilon >= 1`` (one
decode query per request, GQA with the query-head group of a KV head in one program, SGLang's KV layout
``[num_slots, num_kv_heads, head_dim]`` through ``req_to_token``, block sizes 1..128, bf16/fp16 KV, a
partial last block masked by ``seq_len``), and the same outputs (``o``, a BASE-2 ``lse``, entries read per
pair). Two launches, both without host sync or allocation once the buffers are given, so a caller can plan
them once per step and share them across layers (CUDA-graph capturable at a fixed ``num_splits``):

  1. grid ``[batch * num_kv_heads, num_splits]``: program ``(pair, s)`` attends list entries
     ``[s * chunk, min((s + 1) * chunk, list_len))`` and writes a normalised fp32 partial ``o`` and its
     base-2 ``lse`` (``-inf`` for an empty span) into ``partial_o_buf`` / ``partial_lse_buf``. ``chunk`` is the
     pair's own: its ``list_len`` cut into ``num_splits`` tile-aligned spans, so every pair's list spreads over all
     the programs of its row (a span length sized for the widest list a graph takes, ~32k entries, would leave a
     list of ~10k in a third of them: 2.1x the time at 32 rows, ``bench/results/split_decode_row_chunk.md``);
  2. grid ``[batch * num_qo_heads]``: a row's partials merged with the spans as a tensor dimension (the max
     of the span LSEs, then the base-2 weighted sums of ``flashinfer.merge_state``), written in the output
     dtype. A graph's split count is planned for its widest list (up to ~90 spans at 32k), so a merge that
     walked the spans one after another was latency-bound (~20 us a layer on an H100).

Why: :func:`~flashinfer_ext.common.sparse_decode.sparse_decode` runs one program per (request, KV head); at
SmolLM2's 3 KV heads and one request that is 3 programs walking ~1k list entries each, latency-bound
(on an H100 49 us a layer against FlashInfer's 6 us for the whole context).
:func:`plan_splits` picks the split count from the host-known list width and the SM count.

Cautions: the partial buffers hold ``batch * num_kv_heads * num_splits * group * head_dim`` fp32 values;
entries must be distinct and ``< ceil(seq_len / block_size)`` (as for ``sparse_decode``); no PSA stop test
here (use :mod:`flashinfer_ext.psa.decode` for that).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flashinfer_ext.common.sparse_decode import decode_outputs, decode_shapes
from flashinfer_ext.common.tile_attention import attend_slots, group_query_state, list_tile_slots

__all__ = ["SplitPlan", "plan_splits", "sparse_decode_split", "alloc_split_buffers"]


@dataclass(frozen=True)
class SplitPlan:
    """How lists of width up to ``list_width`` are cut: ``num_splits`` spans per (request, KV head) list, each
    ``ceil(ceil(list_len / num_splits) / sub) * sub`` entries of its own list (a multiple of the tile's ``sub``
    entries); ``chunk`` is the span of the widest list (``num_splits * chunk >= list_width``). ``num_warps`` /
    ``num_stages`` are the span kernel's launch."""

    num_splits: int
    chunk: int
    sub: int
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        if self.num_splits < 1:
            raise ValueError(f"num_splits={self.num_splits} must be >= 1")
        if self.sub < 1 or self.chunk < self.sub or self.chunk % self.sub:
            raise ValueError(f"chunk={self.chunk} must be a positive multiple of sub={self.sub}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps={self.num_warps} must be one of 1, 2, 4, 8, 16")
        if not 1 <= self.num_stages <= 6:
            raise ValueError(f"num_stages={self.num_stages} must be in [1, 6]")


def _sub_entries(block_size: int, tile_tokens: int) -> int:
    return max(1, triton.next_power_of_2(max(tile_tokens, 16)) // block_size)


def plan_splits(list_width: int, num_pairs: int, *, block_size: int, target_programs: int,
                tile_tokens: int = 128, min_chunk_tiles: int = 1) -> SplitPlan:
    """Split count for lists of ``list_width`` entries over ``num_pairs`` (request, KV head) pairs: enough
    spans that ``num_pairs * num_splits`` reaches ``target_programs`` (about two waves of SMs), never a span
    shorter than ``min_chunk_tiles`` tiles. Host ints only (the width is a tensor shape: no sync).

    ``tile_tokens`` 128 with 4 warps and 2 stages (the :class:`SplitPlan` defaults): on an H200, SmolLM2's shape
    at 32k with lists of 5.5k-12.8k tokens at batch 1 / 8 / 32, the best average of a sweep of tiles 32 / 64 /
    128, warps 2 / 4 / 8 and stages 1 / 2 / 3 (``bench/sparse_decode_bench.py --sweep``: 0.79-1.02x the time of
    64-token tiles with Triton's default 3 stages)."""
    if list_width < 0 or num_pairs < 0 or target_programs < 1:
        raise ValueError(f"list_width={list_width}, num_pairs={num_pairs} must be >= 0 and "
                         f"target_programs={target_programs} >= 1")
    sub = _sub_entries(block_size, tile_tokens)
    tiles = max(1, -(-list_width // sub))
    want = max(1, -(-target_programs // max(num_pairs, 1)))
    splits = max(1, min(want, tiles // max(min_chunk_tiles, 1)))
    chunk = -(-tiles // splits) * sub
    return SplitPlan(num_splits=max(1, -(-max(list_width, 1) // chunk)), chunk=chunk, sub=sub)


def alloc_split_buffers(batch: int, num_qo_heads: int, head_dim: int, num_splits: int,
                        device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(partial_o_buf [batch * num_qo_heads, num_splits, head_dim] fp32, partial_lse_buf
    [batch * num_qo_heads, num_splits] fp32)``: allocate once per step, share across layers."""
    return (torch.empty(batch * num_qo_heads, num_splits, head_dim, dtype=torch.float32, device=device),
            torch.empty(batch * num_qo_heads, num_splits, dtype=torch.float32, device=device))


@triton.jit(do_not_specialize=["stride_lb", "stride_lh", "stride_llb", "stride_po_row", "stride_plse_row"])
def _split_kernel(
    q_ptr, stride_qb, stride_qh,
    k_ptr, stride_k_slot, stride_k_head, v_ptr, stride_v_slot, stride_v_head,
    rtt_ptr, stride_rtt, rpi_ptr, seq_lens_ptr,
    lists_ptr, stride_lb, stride_lh, list_lens_ptr, stride_llb,
    po_ptr, stride_po_row, stride_po_s, plse_ptr, stride_plse_row,
    sm_scale_log2,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    SUB: tl.constexpr, DOT_FP32: tl.constexpr,
):
    pair = tl.program_id(0)
    s = tl.program_id(1)
    r = pair // NUM_KV_HEADS
    h = pair % NUM_KV_HEADS
    r64 = r.to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + r)
    list_len = tl.load(list_lens_ptr + r64 * stride_llb + h)
    chunk = tl.cdiv(tl.cdiv(list_len, tl.num_programs(1)), SUB) * SUB  # this pair's list in num_splits tile spans
    t_lo = s * chunk
    t_hi = tl.minimum(t_lo + chunk, list_len)
    rtt_row_ptr = rtt_ptr + tl.load(rpi_ptr + r).to(tl.int64) * stride_rtt
    lists_row_ptr = lists_ptr + r64 * stride_lb + h * stride_lh

    q, g, d, gmask, dmask, m_i, l_i, acc = group_query_state(q_ptr, stride_qb, stride_qh, r64, h, k_ptr,
                                                             GROUP, G_PAD, HEAD_DIM, D_PAD)
    TOK: tl.constexpr = SUB * BLOCK_SIZE
    tok = tl.arange(0, TOK)
    for t0 in range(t_lo, t_hi, SUB):
        slot, tvalid = list_tile_slots(lists_row_ptr, rtt_row_ptr, t0, t_hi, seq_len, tok, BLOCK_SIZE)
        m_i, _, l_i, acc, _ = attend_slots(q, k_ptr, v_ptr, stride_k_slot, stride_k_head, stride_v_slot,
                                           stride_v_head, h, slot, tvalid, tvalid[None, :], d, dmask, m_i, l_i, acc,
                                           sm_scale_log2, DOT_FP32)
    has = l_i > 0.0
    l_safe = tl.where(has, l_i, 1.0)
    row = (r64 * NUM_KV_HEADS + h) * GROUP + g  # = r * num_qo_heads + qo head
    tl.store(po_ptr + row[:, None] * stride_po_row + s * stride_po_s + d[None, :], acc / l_safe[:, None],
             mask=gmask[:, None] & dmask[None, :])
    tl.store(plse_ptr + row * stride_plse_row + s, tl.where(has, m_i + tl.log2(l_safe), float("-inf")), mask=gmask)


@triton.jit(do_not_specialize=["stride_po_row", "stride_plse_row", "stride_llb", "num_splits"])
def _merge_kernel(
    po_ptr, stride_po_row, stride_po_s, plse_ptr, stride_plse_row, list_lens_ptr, stride_llb,
    o_ptr, stride_ob, stride_oh, lse_ptr, stride_lseb, nread_ptr, stride_nb,
    num_splits,
    NUM_QO_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    S_TILE: tl.constexpr,
):
    """Program ``row = r * NUM_QO_HEADS + qo``: the row's span partials merged as a tensor over ``S_TILE`` spans
    at a time (two passes: the max of the span LSEs, then the weighted sums), not one span after another."""
    row = tl.program_id(0)
    r = row // NUM_QO_HEADS
    qo = row % NUM_QO_HEADS
    r64 = r.to(tl.int64)
    row64 = row.to(tl.int64)
    sp = tl.arange(0, S_TILE)
    d = tl.arange(0, D_PAD)
    dmask = d < HEAD_DIM
    m = tl.full([S_TILE], float("-inf"), tl.float32)
    for s0 in range(0, num_splits, S_TILE):
        ls = tl.load(plse_ptr + row64 * stride_plse_row + s0 + sp, mask=s0 + sp < num_splits, other=float("-inf"))
        m = tl.maximum(m, ls)
    m_row = tl.max(m, axis=0)
    m_safe = tl.where(m_row == float("-inf"), 0.0, m_row)
    l = tl.zeros([S_TILE], tl.float32)
    acc = tl.zeros([S_TILE, D_PAD], tl.float32)
    for s0 in range(0, num_splits, S_TILE):
        smask = s0 + sp < num_splits
        ls = tl.load(plse_ptr + row64 * stride_plse_row + s0 + sp, mask=smask, other=float("-inf"))
        w = tl.exp2(ls - m_safe)
        os_ = tl.load(po_ptr + row64 * stride_po_row + (s0 + sp)[:, None] * stride_po_s + d[None, :],
                      mask=smask[:, None] & dmask[None, :], other=0.0)
        acc += os_ * w[:, None]
        l += w
    l_row = tl.sum(l, axis=0)
    has = l_row > 0.0
    l_safe = tl.where(has, l_row, 1.0)
    tl.store(o_ptr + r64 * stride_ob + qo * stride_oh + d, (tl.sum(acc, axis=0) / l_safe).to(o_ptr.dtype.element_ty),
             mask=dmask)
    tl.store(lse_ptr + r64 * stride_lseb + qo, tl.where(has, m_row + tl.log2(l_safe), float("-inf")))
    if qo % GROUP == 0:
        h = qo // GROUP
        tl.store(nread_ptr + r64 * stride_nb + h, tl.load(list_lens_ptr + r64 * stride_llb + h))


def sparse_decode_split(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                        req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                        block_lists: torch.Tensor, list_lens: torch.Tensor, plan: SplitPlan, *,
                        block_size: int, sm_scale: float,
                        partial_o_buf: torch.Tensor | None = None, partial_lse_buf: torch.Tensor | None = None,
                        out: torch.Tensor | None = None, lse_out: torch.Tensor | None = None,
                        nread_out: torch.Tensor | None = None):
    """Decode attention over every listed entry of per-(request, KV head) lists, split by ``plan``.

    Args:
      q: ``[batch, num_qo_heads, head_dim]`` (post-RoPE), cast to the KV dtype.
      k_buffer, v_buffer: ``[num_slots, num_kv_heads, head_dim]`` bf16/fp16 (one layer).
      req_to_token: ``[max_reqs, max_context_len]`` int32; req_pool_indices: ``[batch]``; seq_lens ``[batch]`` int32.
      block_lists: ``[batch, num_kv_heads, W]`` logical block ids (any order, distinct, ``< ceil(seq_len /
        block_size)``); list_lens: ``[batch, num_kv_heads]`` int32 entries to read (``<= W``).
      plan: from :func:`plan_splits` with the same ``block_size`` (its ``sub`` is the tile).
      partial_o_buf / partial_lse_buf: from :func:`alloc_split_buffers` (``batch * num_qo_heads`` rows, at least
        ``plan.num_splits`` splits); allocated if None.
      out ``[batch, num_qo_heads, head_dim]`` (default q's dtype), lse_out ``[batch, num_qo_heads]`` fp32 base 2,
      nread_out ``[batch, num_kv_heads]`` int32 (= list_lens); allocated if None.

    Returns ``(out, lse_out, nread_out)``. Two launches; allocation-free when every buffer is given.
    """
    batch, num_qo_heads, head_dim, num_kv_heads = decode_shapes(q, k_buffer, block_size)
    if plan.sub * block_size < 16 or plan.sub & (plan.sub - 1):
        raise ValueError(f"plan.sub={plan.sub} does not tile block_size={block_size} (use plan_splits)")
    out, lse_out, nread_out = decode_outputs(q, num_kv_heads, out, lse_out, nread_out)
    if partial_o_buf is None or partial_lse_buf is None:
        partial_o_buf, partial_lse_buf = alloc_split_buffers(batch, num_qo_heads, head_dim, plan.num_splits, q.device)
    if batch == 0:
        return out, lse_out, nread_out
    if partial_o_buf.shape[0] < batch * num_qo_heads or partial_o_buf.shape[1] < plan.num_splits:
        raise ValueError(f"partial_o_buf {tuple(partial_o_buf.shape)} is smaller than "
                         f"[{batch * num_qo_heads}, {plan.num_splits}, {head_dim}]")
    assert k_buffer.stride(2) == 1 and v_buffer.stride(2) == 1 and q.stride(2) == 1 and out.stride(2) == 1
    assert block_lists.stride(2) == 1 and list_lens.stride(1) == 1
    assert partial_o_buf.stride(2) == 1
    group = num_qo_heads // num_kv_heads
    g_pad = max(16, triton.next_power_of_2(group))
    d_pad = max(16, triton.next_power_of_2(head_dim))
    pairs = batch * num_kv_heads
    _split_kernel[(pairs, plan.num_splits)](
        q, q.stride(0), q.stride(1),
        k_buffer, k_buffer.stride(0), k_buffer.stride(1), v_buffer, v_buffer.stride(0), v_buffer.stride(1),
        req_to_token, req_to_token.stride(0), req_pool_indices, seq_lens,
        block_lists, block_lists.stride(0), block_lists.stride(1), list_lens, list_lens.stride(0),
        partial_o_buf, partial_o_buf.stride(0), partial_o_buf.stride(1), partial_lse_buf, partial_lse_buf.stride(0),
        float(sm_scale) / math.log(2.0),
        NUM_KV_HEADS=num_kv_heads, GROUP=group, G_PAD=g_pad, HEAD_DIM=head_dim, D_PAD=d_pad,
        BLOCK_SIZE=block_size, SUB=plan.sub, DOT_FP32=os.environ.get("TRITON_INTERPRET", "0") == "1",
        num_warps=plan.num_warps, num_stages=plan.num_stages,
    )
    _merge_kernel[(batch * num_qo_heads,)](
        partial_o_buf, partial_o_buf.stride(0), partial_o_buf.stride(1), partial_lse_buf, partial_lse_buf.stride(0),
        list_lens, list_lens.stride(0),
        out, out.stride(0), out.stride(1), lse_out, lse_out.stride(0), nread_out, nread_out.stride(0),
        plan.num_splits,
        NUM_QO_HEADS=num_qo_heads, GROUP=group, HEAD_DIM=head_dim, D_PAD=d_pad,
        S_TILE=min(64, max(16, triton.next_power_of_2(plan.num_splits))), num_warps=2,
    )
    return out, lse_out, nread_out
