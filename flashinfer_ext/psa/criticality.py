"""Block criticality per (request, KV head) from block metadata, with explicit GQA groups.

Supports: the cuboid upper bound ``sum_d max(q_d*min_d, q_d*max_d)`` (computed as
``q+ . max + q- . min``) or the mean score ``q . mean``, for every query head of a KV
head's group, combined by ``max`` or ``sum`` over the group (never an average of the
query heads); sink and local blocks forced to ``+inf`` so a descending sort puts them
first, blocks past a request's end ``-inf``. One Triton launch; ranking is a device
``torch.sort`` into preallocated outputs (no host sync), of the fp32 scores or of
order-preserving int16 keys the kernel can write beside them (a 2-pass radix sort; ties
within a bf16 step of the score rank arbitrarily). :func:`bound_suffix` turns the
scores in rank order into the base-2 log of the remaining-mass upper bound
``sum_{j >= e} block_size * 2^(scale_log2 * s_j)`` at every rank ``e`` (a reverse log-space
cumulative sum, tile-parallel: per-tile log-sums, then each tile's scan plus the tiles after it).

Cautions: scores are in raw ``q.k`` units (no softmax scale; ranking is invariant to
it). ``head_dim`` and the group size are padded to powers of two inside the kernel.
The bound suffix is a true upper bound on the unread softmax numerator only for the
cuboid score with group ``max`` (partial blocks are counted as full: conservative).
Every score is sorted (no partial selection); at 128k context, batch 8, the int16
sort costs a few tens of microseconds per layer.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import triton
import triton.language as tl

__all__ = ["block_criticality", "rank_blocks", "bound_suffix", "suffix_tiles", "CritTile"]


@triton.jit
def _criticality_kernel(
    q_ptr, stride_qb, stride_qh,
    kmin_ptr, kmax_ptr, kmean_ptr, stride_m_row, stride_m_head,
    block_table_ptr, stride_bt, seq_lens_ptr,
    scores_ptr, stride_sb, stride_sh, keys_ptr,
    num_cols, sink_blocks, local_blocks,
    NUM_KV_HEADS: tl.constexpr, HEADS: tl.constexpr, GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_B: tl.constexpr,
    CUBOID: tl.constexpr, REDUCE_MAX: tl.constexpr, WRITE_KEYS: tl.constexpr, RANK_MEAN: tl.constexpr,
):
    # one program: TILE_B blocks of one request x HEADS KV heads (1, or all of them padded to a power of two)
    n_head_tiles = (NUM_KV_HEADS + HEADS - 1) // HEADS
    pid = tl.program_id(0)
    r = pid // n_head_tiles
    h = (pid % n_head_tiles) * HEADS + tl.arange(0, HEADS)  # [HEADS]
    hmask = h < NUM_KV_HEADS
    seq_len = tl.load(seq_lens_ptr + r)
    n_blocks = (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE
    b = tl.program_id(1) * TILE_B + tl.arange(0, TILE_B)
    in_cols = b < num_cols
    valid = b < n_blocks
    rows = tl.load(block_table_ptr + r.to(tl.int64) * stride_bt + b, mask=valid, other=0).to(tl.int64)
    d = tl.arange(0, D_PAD)
    dmask = d < HEAD_DIM
    m_off = rows[:, None, None] * stride_m_row + h[None, :, None] * stride_m_head + d[None, None, :]
    m_mask = valid[:, None, None] & hmask[None, :, None] & dmask[None, None, :]  # [TILE_B, HEADS, D_PAD]
    if CUBOID:
        mx = tl.load(kmax_ptr + m_off, mask=m_mask, other=0.0).to(tl.float32)
        mn = tl.load(kmin_ptr + m_off, mask=m_mask, other=0.0).to(tl.float32)
    if (not CUBOID) or RANK_MEAN:
        me = tl.load(kmean_ptr + m_off, mask=m_mask, other=0.0).to(tl.float32)
    q_off = r.to(tl.int64) * stride_qb + (h[:, None] * GROUP) * stride_qh + d[None, :]  # [HEADS, D_PAD]
    q_mask = hmask[:, None] & dmask[None, :]
    if REDUCE_MAX:
        s = tl.full([TILE_B, HEADS], float("-inf"), tl.float32)
    else:
        s = tl.zeros([TILE_B, HEADS], tl.float32)
    rs = tl.full([TILE_B, HEADS], float("-inf"), tl.float32)  # RANK_MEAN: group max of q . mean (the rank key)
    for gi in tl.static_range(GROUP):  # one query head of each group at a time
        qg = tl.load(q_ptr + q_off + gi * stride_qh, mask=q_mask, other=0.0).to(tl.float32)[None, :, :]
        if CUBOID:
            ub = tl.sum(tl.maximum(qg, 0.0) * mx + tl.minimum(qg, 0.0) * mn, axis=2)
        else:
            ub = tl.sum(qg * me, axis=2)
        if REDUCE_MAX:
            s = tl.maximum(s, ub)
        else:
            s = s + ub
        if RANK_MEAN:
            rs = tl.maximum(rs, tl.sum(qg * me, axis=2))
    forced = ((b < sink_blocks) | (b >= n_blocks - local_blocks))[:, None]
    s = tl.where(forced, float("inf"), s)
    s = tl.where(valid[:, None], s, float("-inf"))
    off = r.to(tl.int64) * stride_sb + h[None, :] * stride_sh + b[:, None]  # [TILE_B, HEADS]
    st_mask = in_cols[:, None] & hmask[None, :]
    tl.store(scores_ptr + off, s, mask=st_mask)
    if WRITE_KEYS:  # order-preserving int16 sort key: the top 16 bits of the fp32 (bf16 truncation)
        if RANK_MEAN:
            rs = tl.where(forced, float("inf"), rs)
            rs = tl.where(valid[:, None], rs, float("-inf"))
            bits = rs.to(tl.int32, bitcast=True) >> 16
        else:
            bits = s.to(tl.int32, bitcast=True) >> 16
        key = bits ^ ((bits >> 15) & 0x7FFF)
        tl.store(keys_ptr + off, key.to(tl.int16), mask=st_mask)


@dataclasses.dataclass(frozen=True)
class CritTile:
    """Launch shape of :func:`block_criticality`: ``tile_b`` blocks x ``heads`` KV heads per program.

    ``heads``: 1 (one KV head per program) or 0 (every KV head of the model, padded to a power of two: one
    program reads a block's metadata of all heads, contiguous in an interleaved :class:`BlockMetaPool`).
    ``tile_b``: blocks per program (a power of two); 0 picks ``elements // (heads_pad * d_pad)`` (at least 1).
    """

    tile_b: int = 0
    heads: int = 1
    elements: int = 8192  # tile_b = 0: target of tile_b x heads_pad x d_pad per metadata tensor
    num_warps: int = 0    # 0: 8 for tiles of >= 8192 elements, else 4

    def __post_init__(self):
        if self.heads not in (0, 1):
            raise ValueError(f"CritTile.heads={self.heads} must be 1 (one KV head per program) or 0 (all)")
        for name in ("tile_b", "elements", "num_warps"):
            v = getattr(self, name)
            if v < 0 or (v and v & (v - 1)):
                raise ValueError(f"CritTile.{name}={v} must be 0 (auto) or a power of two")

    def resolve(self, num_kv_heads: int, head_dim: int) -> tuple[int, int, int]:
        """``(tile_b, heads, num_warps)`` for a model's KV heads and head_dim."""
        d_pad = triton.next_power_of_2(head_dim)
        heads = triton.next_power_of_2(num_kv_heads) if self.heads == 0 else 1
        tile_b = self.tile_b or max(1, min(128, self.elements // (heads * d_pad)))
        tile_b = max(tile_b, 16 // heads if heads < 16 else 1)  # a tile spans >= 16 (block, head) pairs
        warps = self.num_warps or (8 if tile_b * heads * d_pad >= 8192 else 4)
        return tile_b, heads, warps


DEFAULT_TILE = CritTile()


def block_criticality(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, kmean: torch.Tensor,
                      block_table: torch.Tensor, seq_lens: torch.Tensor, scores_out: torch.Tensor, *,
                      block_size: int, sink_blocks: int, local_blocks: int,
                      criticality: str = "cuboid", group_reduce: str = "max",
                      keys_out: torch.Tensor | None = None, rank_by: str = "criticality",
                      tile: CritTile = DEFAULT_TILE) -> torch.Tensor:
    """Score every block of every request for every KV head.

    Args:
      q: ``[batch, num_qo_heads, head_dim]`` decode queries (post-RoPE).
      kmin, kmax, kmean: ``[num_rows, num_kv_heads, head_dim]`` one layer's block metadata (any row and head
        strides, shared by the three; last dim contiguous).
      block_table: ``[batch, >= num_cols]`` int32 logical block -> meta row.
      seq_lens: ``[batch]`` int32 tokens per request (incl. the current one).
      scores_out: ``[batch, num_kv_heads, num_cols]`` fp32, written (last dim contiguous).
      keys_out: optional int16 tensor with ``scores_out``'s shape and strides: an order-preserving
        16-bit key of each score (bf16 truncation), for a 2-pass radix sort (:func:`rank_blocks`).
      rank_by: 'criticality' (keys of ``scores_out``) or 'mean' (keys of the group max of ``q . kmean``;
        ``scores_out`` still gets the criticality scores). Needs ``keys_out`` to matter.
      tile: the launch shape (:class:`CritTile`); results do not depend on it.

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
    assert kmin.stride() == kmax.stride() == kmean.stride()
    if keys_out is not None:
        assert keys_out.dtype == torch.int16 and keys_out.stride() == scores_out.stride()
    tile_b, heads, warps = tile.resolve(num_kv_heads, head_dim)
    grid = (batch * triton.cdiv(num_kv_heads, heads), triton.cdiv(num_cols, tile_b))
    _criticality_kernel[grid](
        q, q.stride(0), q.stride(1),
        kmin, kmax, kmean, kmin.stride(0), kmin.stride(1),
        block_table, block_table.stride(0), seq_lens,
        scores_out, scores_out.stride(0), scores_out.stride(1),
        keys_out if keys_out is not None else scores_out,
        num_cols, sink_blocks, local_blocks,
        NUM_KV_HEADS=num_kv_heads, HEADS=heads, GROUP=group, HEAD_DIM=head_dim,
        D_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size, TILE_B=tile_b,
        CUBOID=criticality == "cuboid", REDUCE_MAX=group_reduce == "max", WRITE_KEYS=keys_out is not None,
        RANK_MEAN=keys_out is not None and rank_by == "mean" and (criticality, group_reduce) != ("mean", "max"),
        num_warps=warps,
    )
    return scores_out


def rank_blocks(keys: torch.Tensor, sorted_out: torch.Tensor, order_out: torch.Tensor) -> torch.Tensor:
    """Descending rank order of ``keys`` ``[batch, num_kv_heads, num_cols]`` into ``order_out`` (int64).

    ``keys``: the fp32 scores, or their int16 keys from :func:`block_criticality` (``keys_out``: a
    2-pass instead of a 4-pass radix sort; ties within a bf16 step of the score rank arbitrarily).
    Device sort into preallocated, contiguous outputs; forced blocks (``+inf``) come first, blocks
    past the end (``-inf``) last.
    """
    torch.sort(keys, dim=-1, descending=True, out=(sorted_out, order_out))
    return order_out


@triton.jit
def _suffix_terms(scores_ptr, order_ptr, row_off, j, num_cols, scale_log2, log2_block, GATHER: tl.constexpr):
    """The base-2 bound terms ``scale_log2 * s + log2(block_size)`` of ranks ``j`` of one row (``-inf`` for forced
    blocks and past ``num_cols``)."""
    if GATHER:
        idx = tl.load(order_ptr + row_off + j, mask=j < num_cols, other=0)
    else:
        idx = j
    s = tl.load(scores_ptr + row_off + idx, mask=j < num_cols, other=float("-inf"))
    return tl.where(s == float("inf"), float("-inf"), s * scale_log2 + log2_block)  # forced blocks excluded


@triton.jit
def _suffix_tiles_kernel(scores_ptr, order_ptr, stride_sb, stride_sh, tiles_ptr, num_cols, n_tiles,
                         scale_log2, log2_block, NUM_KV_HEADS: tl.constexpr, TILE: tl.constexpr,
                         GATHER: tl.constexpr):
    """Phase 1 of the tile-parallel suffix: base-2 log-sum of each tile's bound terms -> ``tiles[pair, t]``."""
    pid = tl.program_id(0)
    t = tl.program_id(1)
    r = (pid // NUM_KV_HEADS).to(tl.int64)
    h = pid % NUM_KV_HEADS
    j = t * TILE + tl.arange(0, TILE)
    x = _suffix_terms(scores_ptr, order_ptr, r * stride_sb + h * stride_sh, j, num_cols, scale_log2, log2_block,
                      GATHER)
    mx = tl.max(x, axis=0)
    mxs = tl.where(mx == float("-inf"), 0.0, mx)
    tl.store(tiles_ptr + pid.to(tl.int64) * n_tiles + t, tl.log2(tl.sum(tl.exp2(x - mxs), axis=0)) + mxs)


@triton.jit
def _suffix_scan_kernel(scores_ptr, order_ptr, stride_sb, stride_sh, out_ptr, stride_ob, stride_oh, tiles_ptr,
                        num_cols, n_tiles, scale_log2, log2_block, NUM_KV_HEADS: tl.constexpr, TILE: tl.constexpr,
                        TILES_PAD: tl.constexpr, GATHER: tl.constexpr):
    """Phase 2: each tile's reverse cumulative log-sum plus the carry of the tiles after it (from phase 1)."""
    pid = tl.program_id(0)
    t = tl.program_id(1)
    r = (pid // NUM_KV_HEADS).to(tl.int64)
    h = pid % NUM_KV_HEADS
    o_row = out_ptr + r * stride_ob + h * stride_oh
    if t == n_tiles - 1:
        tl.store(o_row + num_cols, float("-inf"))
    k = tl.arange(0, TILES_PAD)
    later = tl.load(tiles_ptr + pid.to(tl.int64) * n_tiles + k, mask=(k > t) & (k < n_tiles), other=float("-inf"))
    j = t * TILE + tl.arange(0, TILE)
    x = _suffix_terms(scores_ptr, order_ptr, r * stride_sb + h * stride_sh, j, num_cols, scale_log2, log2_block,
                      GATHER)
    mx = tl.maximum(tl.max(x, axis=0), tl.max(later, axis=0))
    mxs = tl.where(mx == float("-inf"), 0.0, mx)
    cs = tl.cumsum(tl.exp2(x - mxs), axis=0, reverse=True) + tl.sum(tl.exp2(later - mxs), axis=0)
    tl.store(o_row + j, tl.log2(cs) + mxs, mask=j < num_cols)


def suffix_tiles(num_cols: int, tile: int) -> int:
    """Tiles of :func:`bound_suffix`'s tile-parallel path for a row of ``num_cols`` (its scratch per pair)."""
    return triton.cdiv(max(num_cols, 1), tile)


def bound_suffix(scores: torch.Tensor, suffix_out: torch.Tensor, *, sm_scale: float, block_size: int,
                 order: torch.Tensor | None = None, tile: int = 1024,
                 tiles_buf: torch.Tensor | None = None) -> torch.Tensor:
    """Base-2 log of the remaining-mass upper bound at every rank.

    Args:
      scores: ``[batch, num_kv_heads, num_cols]`` fp32 cuboid scores (group max; ``+inf`` forced, ``-inf``
        past the end), last dim contiguous: in rank order, or in block order with ``order`` given.
      suffix_out: ``[batch, num_kv_heads, >= num_cols + 1]`` fp32; entry ``e`` =
        ``log2 sum_{j >= e, s_j finite} block_size * exp(sm_scale * s_j)`` over ranks (``-inf`` when empty).
      order: optional ``[batch, num_kv_heads, num_cols]`` int64 rank -> block (same strides as ``scores``).
      tile: ranks per program (a power of two; clamped to the row).
      tiles_buf: fp32 scratch of ``>= batch * num_kv_heads * suffix_tiles(num_cols, tile)`` elements (the
        tiles' log-sums); allocated here when not given.

    Two launches over ``[pairs, tiles]`` programs: each tile's log-sum, then each tile's reverse scan plus the
    carry of the tiles after it. No allocation when ``tiles_buf`` is given.
    """
    batch, num_kv_heads, num_cols = scores.shape
    if batch == 0:
        return suffix_out
    assert scores.stride(2) == 1 and suffix_out.stride(2) == 1 and suffix_out.shape[2] >= num_cols + 1
    if order is not None:
        assert order.stride() == scores.stride()
    tile = min(tile, triton.next_power_of_2(max(num_cols, 16)))
    scale_log2, log2_block = float(sm_scale) / math.log(2.0), math.log2(block_size)
    order_arg = order if order is not None else scores
    pairs = batch * num_kv_heads
    n_tiles = suffix_tiles(num_cols, tile)
    if tiles_buf is None:
        tiles_buf = torch.empty(pairs * n_tiles, dtype=torch.float32, device=scores.device)
    assert tiles_buf.dtype == torch.float32 and tiles_buf.numel() >= pairs * n_tiles
    warps = 8 if tile >= 2048 else 4
    _suffix_tiles_kernel[(pairs, n_tiles)](
        scores, order_arg, scores.stride(0), scores.stride(1), tiles_buf, num_cols, n_tiles, scale_log2,
        log2_block, NUM_KV_HEADS=num_kv_heads, TILE=tile, GATHER=order is not None, num_warps=warps)
    _suffix_scan_kernel[(pairs, n_tiles)](
        scores, order_arg, scores.stride(0), scores.stride(1), suffix_out, suffix_out.stride(0),
        suffix_out.stride(1), tiles_buf, num_cols, n_tiles, scale_log2, log2_block,
        NUM_KV_HEADS=num_kv_heads, TILE=tile, TILES_PAD=max(16, triton.next_power_of_2(n_tiles)),
        GATHER=order is not None, num_warps=warps)
    return suffix_out
