"""Per-block, per-KV-head key metadata (min, max = the cuboid, and mean), kept current.

Supports: SGLang's KV layout ``k_buffer[layer]`` = ``[num_slots, num_kv_heads, head_dim]``
(keys after RoPE, bf16/fp16/fp32), tokens reached through ``req_to_token[req, pos]``;
page size P > 1 (block = page, meta row = page id = slot // P) and page size 1
(block = ``block_size`` consecutive positions of one request, meta row from a
caller-owned block table); incremental updates of only the blocks a write touched
(decode: one token per request; prefill/extend: a position range per request) in one
Triton launch; a CUDA-graph-safe decode update (no host sync, no allocation).

Cautions:
  * Updates must arrive in position order per request: a range starting inside a
    block folds into that block's stored metadata, assuming it already covers the
    positions ``[block_start, start)``. A range starting at a block boundary resets
    the block, so stale rows never need clearing. After a prefix-cache hit with a
    fresh block table, rebuild with ``start = 0``.
  * The mean is an incremental average computed in fp32 and stored in the pool dtype.
  * Meta memory per layer: ``3 * num_rows * num_kv_heads * head_dim * itemsize``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["BlockMetaPool", "update_block_meta", "paged_block_table", "identity_block_table",
           "blocks_touched"]


@triton.jit
def fold_range(start_ptr, end_ptr, BLOCK_SIZE: tl.constexpr):
    """Program ``(r, j, h)`` of a fold over ``[start[r], end[r])``: returns ``(r, h, b, blk_lo, lo, hi)``, the
    ``j``-th block ``b`` the range touches, its first position and the range's part ``[lo, hi)`` in it (empty when
    ``lo >= hi``)."""
    r = tl.program_id(0)
    j = tl.program_id(1)
    h = tl.program_id(2)
    start = tl.load(start_ptr + r)
    end = tl.load(end_ptr + r)
    b = start // BLOCK_SIZE + j
    blk_lo = b * BLOCK_SIZE
    lo = tl.maximum(start, blk_lo)
    hi = tl.minimum(end, blk_lo + BLOCK_SIZE)
    return r, h, b, blk_lo, lo, hi


@triton.jit
def _update_block_meta_kernel(
    k_ptr, stride_k_slot, stride_k_head,
    kmin_ptr, kmax_ptr, kmean_ptr, stride_m_row, stride_m_head,
    req_to_token_ptr, stride_rtt,
    req_pool_idx_ptr, block_table_ptr, stride_bt,
    start_ptr, end_ptr,
    BLOCK_SIZE: tl.constexpr, BLOCK_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
):
    r, h, b, blk_lo, lo, hi = fold_range(start_ptr, end_ptr, BLOCK_SIZE)
    active = lo < hi
    rpi = tl.load(req_pool_idx_ptr + r).to(tl.int64)
    row = tl.load(block_table_ptr + r.to(tl.int64) * stride_bt + b, mask=active, other=0).to(tl.int64)

    t = tl.arange(0, BLOCK_PAD)
    d = tl.arange(0, D_PAD)
    dmask = d < HEAD_DIM
    pos = blk_lo + t
    valid = (pos >= lo) & (pos < hi) & (t < BLOCK_SIZE)
    slot = tl.load(req_to_token_ptr + rpi * stride_rtt + pos, mask=valid, other=0).to(tl.int64)
    k = tl.load(k_ptr + slot[:, None] * stride_k_slot + h * stride_k_head + d[None, :],
                mask=valid[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    new_min = tl.min(tl.where(valid[:, None], k, float("inf")), axis=0)
    new_max = tl.max(tl.where(valid[:, None], k, float("-inf")), axis=0)
    new_sum = tl.sum(k, axis=0)

    n_old = (lo - blk_lo).to(tl.float32)
    n_new = (hi - lo).to(tl.float32)
    has_old = lo > blk_lo
    m_off = row * stride_m_row + h * stride_m_head + d
    ld_mask = dmask & active & has_old
    old_min = tl.load(kmin_ptr + m_off, mask=ld_mask, other=float("inf")).to(tl.float32)
    old_max = tl.load(kmax_ptr + m_off, mask=ld_mask, other=float("-inf")).to(tl.float32)
    old_mean = tl.load(kmean_ptr + m_off, mask=ld_mask, other=0.0).to(tl.float32)
    out_min = tl.minimum(new_min, old_min)
    out_max = tl.maximum(new_max, old_max)
    out_mean = (old_mean * n_old + new_sum) / tl.maximum(n_old + n_new, 1.0)
    st_mask = dmask & active
    tl.store(kmin_ptr + m_off, out_min.to(kmin_ptr.dtype.element_ty), mask=st_mask)
    tl.store(kmax_ptr + m_off, out_max.to(kmax_ptr.dtype.element_ty), mask=st_mask)
    tl.store(kmean_ptr + m_off, out_mean.to(kmean_ptr.dtype.element_ty), mask=st_mask)


def update_block_meta(k_buffer: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, kmean: torch.Tensor,
                      req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                      block_table: torch.Tensor, start_pos: torch.Tensor, end_pos: torch.Tensor,
                      *, block_size: int, max_new_blocks: int) -> None:
    """Fold the keys written at positions ``[start_pos[r], end_pos[r])`` into their blocks' metadata.

    Args:
      k_buffer: ``[num_slots, num_kv_heads, head_dim]`` one layer's keys (post-RoPE).
      kmin, kmax, kmean: ``[num_rows, num_kv_heads, head_dim]`` that layer's metadata, updated in place.
      req_to_token: ``[max_reqs, max_context_len]`` int32 position -> slot.
      req_pool_indices: ``[batch]`` int32/int64 row of ``req_to_token`` per request.
      block_table: ``[batch, max_blocks_per_req]`` int32 logical block -> meta row.
      start_pos, end_pos: ``[batch]`` int32 written range per request (decode: ``seq_len-1, seq_len``;
        an empty range ``start == end`` is a no-op).
      block_size: tokens per block (the page size for page size > 1).
      max_new_blocks: host int >= the number of blocks any one range touches
        (decode: 1 if every range has one token; see :func:`blocks_touched`).

    One launch over ``[batch, max_new_blocks, num_kv_heads]``; no allocation, no host sync.
    """
    batch = req_pool_indices.shape[0]
    num_kv_heads, head_dim = k_buffer.shape[1], k_buffer.shape[2]
    if batch == 0 or max_new_blocks <= 0:
        return
    assert k_buffer.stride(2) == 1 and kmin.stride(2) == 1
    assert kmin.stride() == kmax.stride() == kmean.stride()
    grid = (batch, max_new_blocks, num_kv_heads)
    _update_block_meta_kernel[grid](
        k_buffer, k_buffer.stride(0), k_buffer.stride(1),
        kmin, kmax, kmean, kmin.stride(0), kmin.stride(1),
        req_to_token, req_to_token.stride(0),
        req_pool_indices, block_table, block_table.stride(0),
        start_pos, end_pos,
        BLOCK_SIZE=block_size, BLOCK_PAD=triton.next_power_of_2(block_size),
        HEAD_DIM=head_dim, D_PAD=triton.next_power_of_2(head_dim),
    )


def blocks_touched(start_pos_host, end_pos_host, block_size: int) -> int:
    """Host helper: the largest number of blocks one ``[start, end)`` range touches (``max_new_blocks``)."""
    best = 0
    for s, e in zip(list(start_pos_host), list(end_pos_host)):
        s, e = int(s), int(e)
        if e > s:
            best = max(best, (e - 1) // block_size - s // block_size + 1)
    return best


def paged_block_table(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, page_size: int,
                      max_blocks_per_req: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Page size > 1: ``[batch, max_blocks_per_req]`` int32 page ids, ``req_to_token[r, b*P] // P``.

    Entries past a request's last page are garbage (kernels mask them by ``seq_lens``).
    Runs on the device of ``req_to_token``; allocates unless ``out`` is given.
    """
    width = req_to_token.shape[1]
    pos = torch.arange(max_blocks_per_req, device=req_to_token.device) * page_size
    pos = pos.clamp_(max=width - 1)
    rows = req_to_token.index_select(0, req_pool_indices.long())
    table = rows.index_select(1, pos) // page_size
    if out is None:
        return table.to(torch.int32)
    out[: table.shape[0], : table.shape[1]].copy_(table)
    return out


def identity_block_table(req_pool_indices: torch.Tensor, max_blocks_per_req: int,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """Page size 1 default: meta row = ``req_pool_idx * max_blocks_per_req + b`` (int32).

    Needs a pool with ``max_reqs * max_blocks_per_req`` rows; a server with a block
    allocator may pass its own table instead.
    """
    b = torch.arange(max_blocks_per_req, device=req_pool_indices.device, dtype=torch.int64)
    table = (req_pool_indices.long()[:, None] * max_blocks_per_req + b[None, :]).to(torch.int32)
    if out is None:
        return table
    out[: table.shape[0], : table.shape[1]].copy_(table)
    return out


class BlockMetaPool:
    """Metadata of every layer: ``kmin/kmax/kmean`` each ``[num_layers, num_rows, num_kv_heads, head_dim]``.

    ``num_rows`` = number of pages (page size > 1) or blocks (page size 1) the pool can hold.
    ``layout``: 'planar' (three separate tensors) or 'interleaved' (one ``[num_layers, num_rows, 3, num_kv_heads,
    head_dim]`` tensor, ``kmin/kmax/kmean`` its strided views: one block's metadata of every head is one contiguous
    span, which a criticality program over all KV heads reads in one sweep). Kernels take the views' strides.
    """

    LAYOUTS = ("planar", "interleaved")

    def __init__(self, num_layers: int, num_rows: int, num_kv_heads: int, head_dim: int,
                 block_size: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 layout: str = "planar"):
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be >= 1")
        if layout not in self.LAYOUTS:
            raise ValueError(f"layout={layout!r} must be one of {self.LAYOUTS}")
        self.block_size = block_size
        self.layout = layout
        self.num_rows = int(num_rows)
        shape = (num_layers, num_rows, num_kv_heads, head_dim)
        if layout == "interleaved":
            self._buf = torch.zeros((num_layers, num_rows, 3, num_kv_heads, head_dim), dtype=dtype, device=device)
            self.kmin, self.kmax, self.kmean = self._buf.unbind(2)
        else:
            self.kmin = torch.zeros(shape, dtype=dtype, device=device)
            self.kmax = torch.zeros(shape, dtype=dtype, device=device)
            self.kmean = torch.zeros(shape, dtype=dtype, device=device)

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(kmin, kmax, kmean)`` of one layer, each ``[num_rows, num_kv_heads, head_dim]`` (views)."""
        return self.kmin[layer_id], self.kmax[layer_id], self.kmean[layer_id]

    def nbytes(self) -> int:
        return 3 * self.kmin.numel() * self.kmin.element_size()

    def rebuild_pages(self, layer_id: int, k_buffer: torch.Tensor, pages: torch.Tensor) -> None:
        """Page size = block size: recompute (min, max, mean) of whole pages ``pages`` (int64 ``[n]``, device) from
        the keys in them. The mean is taken in fp32 over the page (it may differ in the last bit from the kernel's
        incremental mean)."""
        p = self.block_size
        n = k_buffer.shape[0] // p
        kp = k_buffer[: n * p].view(n, p, k_buffer.shape[1], k_buffer.shape[2]).index_select(0, pages)
        kmin, kmax, kmean = self.layer(layer_id)
        kmin.index_copy_(0, pages, kp.amin(1).to(kmin.dtype))
        kmax.index_copy_(0, pages, kp.amax(1).to(kmax.dtype))
        kmean.index_copy_(0, pages, kp.float().mean(1).to(kmean.dtype))

    def update(self, layer_id: int, k_buffer: torch.Tensor, req_to_token: torch.Tensor,
               req_pool_indices: torch.Tensor, block_table: torch.Tensor,
               start_pos: torch.Tensor, end_pos: torch.Tensor, max_new_blocks: int) -> None:
        """:func:`update_block_meta` on layer ``layer_id`` (see there for shapes)."""
        kmin, kmax, kmean = self.layer(layer_id)
        update_block_meta(k_buffer, kmin, kmax, kmean, req_to_token, req_pool_indices, block_table,
                          start_pos, end_pos, block_size=self.block_size, max_new_blocks=max_new_blocks)
