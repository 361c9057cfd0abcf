"""Block criticality per (request, KV head) from block metadata, with explicit GQA groups.

Supports: the cuboid upper bound ``sum_d max(q_d*min_d, q_d*max_d)`` (computed as
``q+ . max + q- . min``) or the mean score ``q . mean``, for every query head of a KV
head's group, combined by ``max`` or ``sum`` over the group (never an average of the
query heads); sink and local blocks forced to ``+inf`` so a descending sort puts them
first, blocks past a request's end ``-inf``. One Triton launch; ranking is a device
``torch.sort`` into preallocated outputs (no host sync). :func:`bound_suffix` turns the
sorted scores into the base-2 log of the remaining-mass upper bound
``sum_{j >= e} block_size * 2^(scale_log2 * s_j)`` at every rank ``e`` (one program per
(request, KV head), a reverse log-space cumulative sum in tiles).

Cautions: scores are in raw ``q.k`` units (no softmax scale; ranking is invariant to
it). ``head_dim`` and the group size are padded to powers of two inside the kernel.
The bound suffix is a true upper bound on the unread softmax numerator only for the
cuboid score with group ``max`` (partial blocks are counted as full: conservative).
The full sort of every score is kept for simplicity; at 128k context it costs a few
tens of microseconds per layer (a partial selection would save part of it).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

__all__ = ["block_criticality", "rank_blocks", "bound_suffix"]


@triton.jit
def _criticality_kernel(
    q_ptr, stride_qb, stride_qh,
    kmin_ptr, kmax_ptr, kmean_ptr, stride_m_row, stride_m_head,
    block_table_ptr, stride_bt, seq_lens_ptr,
    scores_ptr, stride_sb, stride_sh,
    num_cols, sink_blocks, local_blocks,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_B: tl.constexpr,
    CUBOID: tl.constexpr, REDUCE_MAX: tl.constexpr,
):
    pid = tl.program_id(0)
    r = pid // NUM_KV_HEADS
    h = pid % NUM_KV_HEADS
    seq_len = tl.load(seq_lens_ptr + r)
    n_blocks = (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE
    b = tl.program_id(1) * TILE_B + tl.arange(0, TILE_B)
    in_cols = b < num_cols
    valid = b < n_blocks
    rows = tl.load(block_table_ptr + r.to(tl.int64) * stride_bt + b, mask=valid, other=0).to(tl.int64)

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    gmask = g < GROUP
    dmask = d < HEAD_DIM
    q = tl.load(q_ptr + r.to(tl.int64) * stride_qb + (h * GROUP + g)[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)  # [G_PAD, D_PAD]
    m_off = rows[:, None] * stride_m_row + h * stride_m_head + d[None, :]
    m_mask = valid[:, None] & dmask[None, :]
    if CUBOID:
        mx = tl.load(kmax_ptr + m_off, mask=m_mask, other=0.0).to(tl.float32)  # [TILE_B, D_PAD]
        mn = tl.load(kmin_ptr + m_off, mask=m_mask, other=0.0).to(tl.float32)
        qp = tl.maximum(q, 0.0)
        qn = tl.minimum(q, 0.0)
        ub = tl.sum(qp[:, None, :] * mx[None, :, :] + qn[:, None, :] * mn[None, :, :], axis=2)
    else:
        me = tl.load(kmean_ptr + m_off, mask=m_mask, other=0.0).to(tl.float32)
        ub = tl.sum(q[:, None, :] * me[None, :, :], axis=2)  # [G_PAD, TILE_B]
    if REDUCE_MAX:
        s = tl.max(tl.where(gmask[:, None], ub, float("-inf")), axis=0)
    else:
        s = tl.sum(tl.where(gmask[:, None], ub, 0.0), axis=0)
    forced = (b < sink_blocks) | (b >= n_blocks - local_blocks)
    s = tl.where(forced, float("inf"), s)
    s = tl.where(valid, s, float("-inf"))
    tl.store(scores_ptr + r.to(tl.int64) * stride_sb + h * stride_sh + b, s, mask=in_cols)


def block_criticality(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, kmean: torch.Tensor,
                      block_table: torch.Tensor, seq_lens: torch.Tensor, scores_out: torch.Tensor, *,
                      block_size: int, sink_blocks: int, local_blocks: int,
                      criticality: str = "cuboid", group_reduce: str = "max") -> torch.Tensor:
    """Score every block of every request for every KV head.

    Args:
      q: ``[batch, num_qo_heads, head_dim]`` decode queries (post-RoPE).
      kmin, kmax, kmean: ``[num_rows, num_kv_heads, head_dim]`` one layer's block metadata.
      block_table: ``[batch, >= num_cols]`` int32 logical block -> meta row.
      seq_lens: ``[batch]`` int32 tokens per request (incl. the current one).
      scores_out: ``[batch, num_kv_heads, num_cols]`` fp32, written (last dim contiguous).

    Returns ``scores_out``. One launch, no allocation.
    """
    batch, num_qo_heads, head_dim = q.shape
    num_kv_heads = kmin.shape[1]
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"num_qo_heads={num_qo_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    group = num_qo_heads // num_kv_heads
    num_cols = scores_out.shape[2]
    if batch == 0 or num_cols == 0:
        return scores_out
    assert q.stride(2) == 1 and kmin.stride(2) == 1 and scores_out.stride(2) == 1
    g_pad = triton.next_power_of_2(group)
    d_pad = triton.next_power_of_2(head_dim)
    tile_b = max(1, min(64, 4096 // (g_pad * d_pad)))
    grid = (batch * num_kv_heads, triton.cdiv(num_cols, tile_b))
    _criticality_kernel[grid](
        q, q.stride(0), q.stride(1),
        kmin, kmax, kmean, kmin.stride(0), kmin.stride(1),
        block_table, block_table.stride(0), seq_lens,
        scores_out, scores_out.stride(0), scores_out.stride(1),
        num_cols, sink_blocks, local_blocks,
        NUM_KV_HEADS=num_kv_heads, GROUP=group, G_PAD=g_pad, HEAD_DIM=head_dim, D_PAD=d_pad,
        BLOCK_SIZE=block_size, TILE_B=tile_b,
        CUBOID=criticality == "cuboid", REDUCE_MAX=group_reduce == "max",
    )
    return scores_out


def rank_blocks(scores: torch.Tensor, sorted_out: torch.Tensor, order_out: torch.Tensor) -> torch.Tensor:
    """Descending rank order of ``scores`` ``[batch, num_kv_heads, num_cols]`` into ``order_out`` (int64).

    Device sort into preallocated, contiguous outputs; forced blocks (``+inf``) come first,
    blocks past the end (``-inf``) last.
    """
    torch.sort(scores, dim=-1, descending=True, out=(sorted_out, order_out))
    return order_out


@triton.jit
def _bound_suffix_kernel(sorted_ptr, stride_sb, stride_sh, out_ptr, stride_ob, stride_oh, num_cols,
                         scale_log2, log2_block, NUM_KV_HEADS: tl.constexpr, TILE: tl.constexpr):
    pid = tl.program_id(0)
    r = (pid // NUM_KV_HEADS).to(tl.int64)
    h = pid % NUM_KV_HEADS
    s_row = sorted_ptr + r * stride_sb + h * stride_sh
    o_row = out_ptr + r * stride_ob + h * stride_oh
    tl.store(o_row + num_cols, float("-inf"))
    run = tl.full([1], float("-inf"), tl.float32)  # log2 suffix sum past the current tile
    n_tiles = tl.cdiv(num_cols, TILE)
    for it in range(0, n_tiles):
        start = (n_tiles - 1 - it) * TILE
        j = start + tl.arange(0, TILE)
        s = tl.load(s_row + j, mask=j < num_cols, other=float("-inf"))
        x = tl.where(s == float("inf"), float("-inf"), s * scale_log2 + log2_block)  # forced blocks excluded
        mx = tl.maximum(tl.max(x, axis=0), tl.max(run, axis=0))
        mxs = tl.where(mx == float("-inf"), 0.0, mx)
        cs = tl.cumsum(tl.exp2(x - mxs), axis=0, reverse=True) + tl.sum(tl.exp2(run - mxs), axis=0)
        suf = tl.log2(cs) + mxs
        tl.store(o_row + j, suf, mask=j < num_cols)
        run = tl.full([1], 0.0, tl.float32) + tl.max(tl.where(j == start, suf, float("-inf")), axis=0)


def bound_suffix(sorted_scores: torch.Tensor, suffix_out: torch.Tensor, *, sm_scale: float, block_size: int,
                 tile: int = 1024) -> torch.Tensor:
    """Base-2 log of the remaining-mass upper bound at every rank.

    Args:
      sorted_scores: ``[batch, num_kv_heads, num_cols]`` fp32 descending (cuboid, group max; ``+inf``
        forced blocks first, ``-inf`` past the end), last dim contiguous.
      suffix_out: ``[batch, num_kv_heads, >= num_cols + 1]`` fp32; entry ``e`` =
        ``log2 sum_{j >= e, s_j finite} block_size * exp(sm_scale * s_j)`` (``-inf`` when empty).

    One launch over ``batch * num_kv_heads`` programs; no allocation.
    """
    batch, num_kv_heads, num_cols = sorted_scores.shape
    if batch == 0:
        return suffix_out
    assert sorted_scores.stride(2) == 1 and suffix_out.stride(2) == 1 and suffix_out.shape[2] >= num_cols + 1
    _bound_suffix_kernel[(batch * num_kv_heads,)](
        sorted_scores, sorted_scores.stride(0), sorted_scores.stride(1),
        suffix_out, suffix_out.stride(0), suffix_out.stride(1), num_cols,
        float(sm_scale) / math.log(2.0), math.log2(block_size),
        NUM_KV_HEADS=num_kv_heads, TILE=min(tile, triton.next_power_of_2(max(num_cols, 16))))
    return suffix_out
