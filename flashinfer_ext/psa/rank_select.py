"""Partial ranking of block scores: exact top-K prefix (sorted), the other blocks after it in block order.

Supports: the int16 order-preserving keys of :func:`flashinfer_ext.psa.criticality.block_criticality`
(``keys_out``), ``[batch, num_kv_heads, num_cols]``, ``num_cols <= 65536``. One Triton program
per (request, KV head): a two-level radix select (256-bin histograms of the key's high byte, then
of the low byte inside the threshold bin) finds the K-th largest key, one pass compacts the top K
blocks into a scratch row and writes every other block, in block order, to ranks ``[K, num_cols)``,
and an in-register bitonic sort (``tl.sort``) of the candidates packed as int32 (key high, block id low) orders
them (ranks ``[0, K)``).
With ``num_cols <= K`` this is a full sort. One launch, no allocation, no host sync; it replaces
a segmented ``torch.sort`` (about 60 us at 64 x 8192 on an H100, mostly fixed overhead).

Cautions: ranks past K are not sorted (block order), which only matters for pairs that read more
than K blocks: they still attend the right set for their stop point (every estimator sums what
is left in the actual order), but read less useful blocks first past rank K. Keep K above the
sink + local blocks (forced blocks must rank first; the wrapper enforces it). Ties at the K-th key
are taken in block order; ties inside the sorted prefix rank the higher block id first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["rank_select"]


@triton.jit
def _rank_select_kernel(keys_ptr, stride_kb, stride_kh, order_ptr, stride_ob, stride_oh, scratch_ptr, num_cols,
                        NUM_KV_HEADS: tl.constexpr, TILE: tl.constexpr, KC: tl.constexpr):
    pid = tl.program_id(0)
    r = (pid // NUM_KV_HEADS).to(tl.int64)
    h = pid % NUM_KV_HEADS
    krow = keys_ptr + r * stride_kb + h * stride_kh
    orow = order_ptr + r * stride_ob + h * stride_oh
    srow = scratch_ptr + pid.to(tl.int64) * KC
    n_tiles = tl.cdiv(num_cols, TILE)
    bins = tl.arange(0, 256)
    # pass A: histogram of the high byte of the unsigned key
    hist = tl.zeros([256], tl.int32)
    for t in range(0, n_tiles):
        j = t * TILE + tl.arange(0, TILE)
        m = j < num_cols
        u = tl.load(krow + j, mask=m, other=0).to(tl.int32) + 32768
        hist += tl.histogram(u >> 8, 256, mask=m)
    cum = tl.cumsum(hist, 0, reverse=True)  # blocks with high byte >= b
    hb_t = tl.max(tl.where(cum >= KC, bins, -1), axis=0)  # -1: fewer than KC blocks, take all
    above = tl.sum(tl.where(bins > hb_t, hist, 0), axis=0)
    need = KC - above
    # pass B: histogram of the low byte inside the threshold bin
    hist2 = tl.zeros([256], tl.int32)
    for t in range(0, n_tiles):
        j = t * TILE + tl.arange(0, TILE)
        m = j < num_cols
        u = tl.load(krow + j, mask=m, other=0).to(tl.int32) + 32768
        hist2 += tl.histogram(u & 255, 256, mask=m & ((u >> 8) == hb_t))
    cum2 = tl.cumsum(hist2, 0, reverse=True)
    lo_t = tl.max(tl.where(cum2 >= need, bins, -1), axis=0)
    c2 = tl.sum(tl.where(bins > lo_t, hist2, 0), axis=0)
    thr = tl.where(hb_t >= 0, hb_t * 256 + lo_t, -1)  # keys > thr are in, ties at thr fill up to KC
    ties_take = tl.where(hb_t >= 0, need - c2, 0)
    n_take = tl.minimum(num_cols, KC)
    # pass C: compact the candidates, write the others in block order after them
    cand_base = 0
    tie_base = 0
    tail_base = 0
    for t in range(0, n_tiles):
        j = t * TILE + tl.arange(0, TILE)
        m = j < num_cols
        u = tl.load(krow + j, mask=m, other=0).to(tl.int32) + 32768
        tie = m & (u == thr)
        tie_rank = tie_base + tl.cumsum(tie.to(tl.int32), 0) - 1
        cand = (m & (u > thr)) | (tie & (tie_rank < ties_take))
        ci = cand.to(tl.int32)
        cpos = cand_base + tl.cumsum(ci, 0) - 1
        # (key, block id) packed in one int32: the signed 16-bit key in the high half, the block id in the low one
        tl.store(srow + cpos, (u - 32768) * 65536 + j, mask=cand)
        tail = m & (ci == 0)
        ti = tail.to(tl.int32)
        tpos = n_take + tail_base + tl.cumsum(ti, 0) - 1
        tl.store(orow + tpos, j.to(tl.int64), mask=tail)
        cand_base += tl.sum(ci, axis=0)
        tie_base += tl.sum(tie.to(tl.int32), axis=0)
        tail_base += tl.sum(ti, axis=0)
    # sort the candidates (key, block id) descending, in registers; the padding is the smallest int32, which only a
    # (lowest key, block 0) candidate equals: equal values, the same block id written either way
    c = tl.arange(0, KC)
    v = tl.load(srow + c, mask=c < n_take, other=-2147483648)
    v = tl.sort(v, descending=True)
    tl.store(orow + c, (v & 65535).to(tl.int64), mask=c < n_take)


def rank_select(keys: torch.Tensor, order_out: torch.Tensor, scratch: torch.Tensor, *, prefix: int,
                tile: int = 4096) -> torch.Tensor:
    """Rank order with an exactly sorted top-``prefix``, the rest in block order.

    Args:
      keys: ``[batch, num_kv_heads, num_cols]`` int16 order-preserving score keys (last dim contiguous).
      order_out: ``[batch, num_kv_heads, num_cols]`` int64, written (rank -> block).
      scratch: int32 with ``>= batch * num_kv_heads * prefix`` elements.
      prefix: power of two in [16, 8192].

    Returns ``order_out``. One launch.
    """
    batch, num_kv_heads, num_cols = keys.shape
    if batch == 0 or num_cols == 0:
        return order_out
    if prefix < 16 or prefix > 8192 or prefix & (prefix - 1):
        raise ValueError(f"prefix={prefix} must be a power of two in [16, 8192]")
    if num_cols > 65536:
        raise ValueError(f"num_cols={num_cols} > 65536 is not supported by rank_select")
    assert keys.dtype == torch.int16 and keys.stride(2) == 1 and order_out.stride(2) == 1
    assert scratch.dtype == torch.int32 and scratch.numel() >= batch * num_kv_heads * prefix
    _rank_select_kernel[(batch * num_kv_heads,)](
        keys, keys.stride(0), keys.stride(1), order_out, order_out.stride(0), order_out.stride(1), scratch,
        num_cols, NUM_KV_HEADS=num_kv_heads, TILE=min(tile, triton.next_power_of_2(max(num_cols, 16))),
        KC=prefix, num_warps=8 if prefix >= 1024 or num_cols >= 2048 else 4)
    return order_out
