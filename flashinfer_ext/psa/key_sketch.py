"""PSA's key sketch: every key kept a second time as int4, to rank blocks and drive the stop test.

Supports: a per-token int4 copy of one layer's keys, stored per block row beside the KV pool
(:class:`KeySketchPool`: ``codes`` ``[num_rows, num_kv_heads, block_size, head_dim // 2]`` uint8 and
``scales`` ``[num_rows, num_kv_heads, block_size]`` fp16, i.e. ``head_dim / 2 + 2`` bytes per token and KV
head), written at the same points as PSA's block metadata (:func:`update_key_sketch`, ranges of positions
through a block table), and the two passes of the sketch stop test:

* :func:`sketch_block_mass`: per (request, KV head, query head of the group, block) the base-2 log of the
  block's approximate softmax numerator ``sum_t 2^(scale_log2 * q . k_sketch_t)`` (one Triton launch);
* :func:`sketch_shares`: per (request, KV head) the base-2 log of each query head's total approximate mass
  ``T_g``, and per block the group max of the approximate mass *shares* ``max_g (lm_g(b) - T_g)`` (``+inf`` for
  sink / local blocks, ``-inf`` past the end) with its order-preserving int16 sort key.

The stop test then ranks blocks by the share and sets, for query head ``g`` after ``e`` ranks read, the unread
mass to ``R_g(e) = 2^(T_g + calib_slack) * sum_{rank >= e} 2^share`` (a suffix sum from
:func:`flashinfer_ext.psa.criticality.bound_suffix`), which is at least head ``g``'s own approximate unread mass.

Quantization: symmetric int4 with one scale per (token, KV head): ``scale = fp16(max(|k|) / 7)`` (at least
``1e-4``), ``code = clamp(floor(k / scale + 0.5), -7, 7)``; byte ``j`` of a token holds dimension ``j`` in its low
nibble and dimension ``j + head_dim / 2`` in its high nibble, each as ``code + 8``.

Cautions: the sketch is an estimate, not a bound: a block whose int4 logits are far below its real ones can
be left unread (``calib_slack`` is the margin). ``head_dim`` must be even. Requires ``block_size`` a power of two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .block_meta import fold_range

__all__ = ["KeySketchPool", "quantize_keys_reference", "update_key_sketch", "sketch_block_mass", "sketch_shares",
           "sketch_scores_reference", "SKETCH_MIN_SCALE"]

SKETCH_MIN_SCALE = 1e-4
LOG2E = 1.4426950408889634


def quantize_keys_reference(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``k`` ``[..., head_dim]`` -> ``(codes int8 [..., head_dim] in [-7, 7], scales fp16 [...])`` (the kernel's rule)."""
    kf = k.float()
    scale = torch.clamp(kf.abs().amax(-1) / 7.0, min=SKETCH_MIN_SCALE).half()
    codes = torch.clamp(torch.floor(kf / scale.float()[..., None] + 0.5), -7, 7).to(torch.int8)
    return codes, scale


def dequantize_reference(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 keys ``[..., head_dim]`` of :func:`quantize_keys_reference`'s ``(codes, scales)``."""
    return codes.float() * scales.float()[..., None]


@triton.jit
def _update_sketch_kernel(
    k_ptr, stride_k_slot, stride_k_head,
    codes_ptr, stride_c_row, stride_c_head, scales_ptr, stride_s_row, stride_s_head,
    req_to_token_ptr, stride_rtt, req_pool_idx_ptr, block_table_ptr, stride_bt, start_ptr, end_ptr,
    BLOCK_SIZE: tl.constexpr, BLOCK_PAD: tl.constexpr, HALF: tl.constexpr, H_PAD: tl.constexpr,
    MIN_SCALE: tl.constexpr,
):
    r, h, b, blk_lo, lo, hi = fold_range(start_ptr, end_ptr, BLOCK_SIZE)
    if lo < hi:
        rpi = tl.load(req_pool_idx_ptr + r).to(tl.int64)
        row = tl.load(block_table_ptr + r.to(tl.int64) * stride_bt + b).to(tl.int64)
        t = tl.arange(0, BLOCK_PAD)
        pos = blk_lo + t
        valid = (pos >= lo) & (pos < hi) & (t < BLOCK_SIZE)
        slot = tl.load(req_to_token_ptr + rpi * stride_rtt + pos, mask=valid, other=0).to(tl.int64)
        e = tl.arange(0, H_PAD)
        emask = e < HALF
        m2 = valid[:, None] & emask[None, :]
        base = k_ptr + slot[:, None] * stride_k_slot + h * stride_k_head + e[None, :]
        k_lo = tl.load(base, mask=m2, other=0.0).to(tl.float32)
        k_hi = tl.load(base + HALF, mask=m2, other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(k_lo), axis=1), tl.max(tl.abs(k_hi), axis=1))
        scale = tl.maximum(tl.math.div_rn(amax, 7.0), MIN_SCALE).to(tl.float16)
        sf = scale.to(tl.float32)
        c_lo = tl.minimum(tl.maximum(tl.floor(tl.math.div_rn(k_lo, sf[:, None]) + 0.5), -7.0), 7.0) + 8.0
        c_hi = tl.minimum(tl.maximum(tl.floor(tl.math.div_rn(k_hi, sf[:, None]) + 0.5), -7.0), 7.0) + 8.0
        byte = (c_lo.to(tl.int32) | (c_hi.to(tl.int32) << 4)).to(tl.uint8)
        c_off = row * stride_c_row + h * stride_c_head + t[:, None] * HALF + e[None, :]
        tl.store(codes_ptr + c_off, byte, mask=m2)
        tl.store(scales_ptr + row * stride_s_row + h * stride_s_head + t, scale, mask=valid)


def update_key_sketch(k_buffer: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                      req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, block_table: torch.Tensor,
                      start_pos: torch.Tensor, end_pos: torch.Tensor, *, block_size: int, max_new_blocks: int) -> None:
    """Quantize the keys at positions ``[start_pos[r], end_pos[r])`` into their blocks' sketch rows.

    Args:
      k_buffer: ``[num_slots, num_kv_heads, head_dim]`` one layer's keys (post-RoPE), bf16/fp16/fp32.
      codes: ``[num_rows, num_kv_heads, block_size, head_dim // 2]`` uint8; scales: ``[num_rows, num_kv_heads,
        block_size]`` fp16 (that layer's sketch, written in place; the token dims contiguous).
      req_to_token, req_pool_indices, block_table, start_pos, end_pos, block_size, max_new_blocks: as
        :func:`flashinfer_ext.psa.block_meta.update_block_meta`.

    One launch over ``[batch, max_new_blocks, num_kv_heads]``; no allocation, no host sync; graph-capturable.
    """
    batch = req_pool_indices.shape[0]
    num_kv_heads, head_dim = k_buffer.shape[1], k_buffer.shape[2]
    if batch == 0 or max_new_blocks <= 0:
        return
    if head_dim % 2:
        raise ValueError(f"head_dim={head_dim} must be even for the int4 key sketch")
    assert k_buffer.stride(2) == 1 and codes.dtype == torch.uint8 and scales.dtype == torch.float16
    assert codes.stride(3) == 1 and codes.stride(2) == head_dim // 2 and scales.stride(2) == 1
    half = head_dim // 2
    _update_sketch_kernel[(batch, max_new_blocks, num_kv_heads)](
        k_buffer, k_buffer.stride(0), k_buffer.stride(1),
        codes, codes.stride(0), codes.stride(1), scales, scales.stride(0), scales.stride(1),
        req_to_token, req_to_token.stride(0), req_pool_indices, block_table, block_table.stride(0),
        start_pos, end_pos,
        BLOCK_SIZE=block_size, BLOCK_PAD=triton.next_power_of_2(block_size), HALF=half,
        H_PAD=triton.next_power_of_2(half), MIN_SCALE=SKETCH_MIN_SCALE,
    )


@triton.jit
def _pair_blocks(seq_lens_ptr, NUM_KV_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Program axis 0 = (request, KV head) pair: ``(pair, r, h, r as int64, seq_len, blocks of the request)``."""
    pair = tl.program_id(0)
    r = pair // NUM_KV_HEADS
    seq_len = tl.load(seq_lens_ptr + r)
    return pair, r, pair % NUM_KV_HEADS, r.to(tl.int64), seq_len, (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE


@triton.jit
def _block_mass_kernel(
    q_ptr, stride_qb, stride_qh,
    codes_ptr, stride_c_row, stride_c_head, scales_ptr, stride_s_row, stride_s_head,
    block_table_ptr, stride_bt, seq_lens_ptr,
    mass_ptr, stride_mb, stride_mh, stride_mg, num_cols, scale_log2,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HALF: tl.constexpr, H_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_B: tl.constexpr,
):
    pair, r, h, r64, seq_len, n_blocks = _pair_blocks(seq_lens_ptr, NUM_KV_HEADS, BLOCK_SIZE)
    b = tl.program_id(1) * TILE_B + tl.arange(0, TILE_B)
    valid_b = b < n_blocks
    rows = tl.load(block_table_ptr + r64 * stride_bt + b, mask=valid_b, other=0).to(tl.int64)
    t = tl.arange(0, BLOCK_SIZE)
    e = tl.arange(0, H_PAD)
    tok_ok = valid_b[:, None] & ((b[:, None] * BLOCK_SIZE + t[None, :]) < seq_len)  # [TILE_B, BLOCK_SIZE]
    c_off = (rows[:, None, None] * stride_c_row + h * stride_c_head + t[None, :, None] * HALF + e[None, None, :])
    c = tl.load(codes_ptr + c_off, mask=tok_ok[:, :, None] & (e < HALF)[None, None, :], other=136).to(tl.int32)
    c_lo = ((c & 15) - 8).to(tl.float32)
    c_hi = ((c >> 4) - 8).to(tl.float32)
    sc = tl.load(scales_ptr + rows[:, None] * stride_s_row + h * stride_s_head + t[None, :], mask=tok_ok,
                 other=0.0).to(tl.float32) * scale_log2
    q_base = q_ptr + r64 * stride_qb + (h * GROUP) * stride_qh
    for gi in tl.static_range(GROUP):
        q_lo = tl.load(q_base + gi * stride_qh + e, mask=e < HALF, other=0.0).to(tl.float32)
        q_hi = tl.load(q_base + gi * stride_qh + HALF + e, mask=e < HALF, other=0.0).to(tl.float32)
        dot = tl.sum(c_lo * q_lo[None, None, :] + c_hi * q_hi[None, None, :], axis=2)  # [TILE_B, BLOCK_SIZE]
        x = tl.where(tok_ok, dot * sc, float("-inf"))
        mx = tl.max(x, axis=1)
        mxs = tl.where(mx == float("-inf"), 0.0, mx)
        lm = tl.log2(tl.sum(tl.exp2(x - mxs[:, None]), axis=1)) + mxs
        lm = tl.where(valid_b, lm, float("-inf"))
        tl.store(mass_ptr + r64 * stride_mb + h * stride_mh + gi * stride_mg + b, lm, mask=b < num_cols)


def sketch_block_mass(q: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, block_table: torch.Tensor,
                      seq_lens: torch.Tensor, mass_out: torch.Tensor, *, block_size: int, sm_scale: float,
                      tile_b: int = 0) -> torch.Tensor:
    """Base-2 log of every block's approximate softmax numerator, per query head.

    Args:
      q: ``[batch, num_qo_heads, head_dim]`` post-RoPE decode queries.
      codes, scales: one layer's sketch (see :func:`update_key_sketch`).
      block_table: ``[batch, >= num_cols]`` int32 logical block -> sketch row; seq_lens: ``[batch]`` int32.
      mass_out: ``[batch, num_kv_heads, group, num_cols]`` fp32 (last dim contiguous): entry ``b`` =
        ``log2 sum_{t in block b} 2^(sm_scale * log2(e) * q_g . k_sketch_t)`` (``-inf`` past the end).
      tile_b: blocks per program (0: ``4096 // (block_size * head_dim / 2)``, at least 1).
    One launch over ``[batch * num_kv_heads, ceil(num_cols / tile_b)]``; no allocation.
    """
    batch, num_qo_heads, head_dim = q.shape
    num_kv_heads = codes.shape[1]
    group = num_qo_heads // num_kv_heads
    num_cols = mass_out.shape[3]
    if batch == 0 or num_cols == 0:
        return mass_out
    assert mass_out.stride(3) == 1 and q.stride(2) == 1
    half = head_dim // 2
    h_pad = triton.next_power_of_2(half)
    tile_b = tile_b or max(1, min(64, 4096 // (block_size * h_pad)))
    tile_b = triton.next_power_of_2(tile_b)
    grid = (batch * num_kv_heads, triton.cdiv(num_cols, tile_b))
    _block_mass_kernel[grid](
        q, q.stride(0), q.stride(1),
        codes, codes.stride(0), codes.stride(1), scales, scales.stride(0), scales.stride(1),
        block_table, block_table.stride(0), seq_lens,
        mass_out, mass_out.stride(0), mass_out.stride(1), mass_out.stride(2), num_cols, float(sm_scale) * LOG2E,
        NUM_KV_HEADS=num_kv_heads, GROUP=group, HALF=half, H_PAD=h_pad, BLOCK_SIZE=block_size, TILE_B=tile_b,
        num_warps=4,
    )
    return mass_out


@triton.jit
def _shares_kernel(
    mass_ptr, stride_mb, stride_mh, stride_mg, seq_lens_ptr,
    scores_ptr, stride_sb, stride_sh, keys_ptr, tot_ptr,
    num_cols, sink_blocks, local_blocks,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr, WRITE_KEYS: tl.constexpr,
):
    pair, r, h, r64, seq_len, n_blocks = _pair_blocks(seq_lens_ptr, NUM_KV_HEADS, BLOCK_SIZE)
    n_blocks = tl.minimum(n_blocks, num_cols)
    g = tl.arange(0, G_PAD)
    gmask = g < GROUP
    m_row = mass_ptr + r64 * stride_mb + h * stride_mh + g[:, None] * stride_mg
    # pass 1: each query head's total (base-2 log-sum over every block)
    run_m = tl.full([G_PAD], float("-inf"), tl.float32)
    run_s = tl.zeros([G_PAD], tl.float32)
    for c0 in range(0, n_blocks, TILE):
        b = c0 + tl.arange(0, TILE)
        x = tl.load(m_row + b[None, :], mask=gmask[:, None] & (b < n_blocks)[None, :], other=float("-inf"))
        new_m = tl.maximum(run_m, tl.max(x, axis=1))
        nms = tl.where(new_m == float("-inf"), 0.0, new_m)
        run_s = run_s * tl.exp2(run_m - nms) + tl.sum(tl.exp2(x - nms[:, None]), axis=1)
        run_m = new_m
    tot = tl.where(run_s > 0.0, tl.log2(tl.maximum(run_s, 1e-38)) + tl.where(run_m == float("-inf"), 0.0, run_m),
                   float("-inf"))
    tl.store(tot_ptr + pair.to(tl.int64) * GROUP + g, tot, mask=gmask)
    tot_s = tl.where(tot == float("-inf"), 0.0, tot)
    # pass 2: the group max of the shares, forced blocks +inf, past the end -inf
    s_row = r64 * stride_sb + h * stride_sh
    for c0 in range(0, num_cols, TILE):
        b = c0 + tl.arange(0, TILE)
        x = tl.load(m_row + b[None, :], mask=gmask[:, None] & (b < n_blocks)[None, :], other=float("-inf"))
        s = tl.max(x - tot_s[:, None], axis=0)
        forced = (b < sink_blocks) | (b >= n_blocks - local_blocks)
        s = tl.where(forced, float("inf"), s)
        s = tl.where(b < n_blocks, s, float("-inf")).to(tl.float32)
        tl.store(scores_ptr + s_row + b, s, mask=b < num_cols)
        if WRITE_KEYS:
            bits = s.to(tl.int32, bitcast=True) >> 16
            key = bits ^ ((bits >> 15) & 0x7FFF)
            tl.store(keys_ptr + s_row + b, key.to(tl.int16), mask=b < num_cols)


def sketch_shares(mass: torch.Tensor, seq_lens: torch.Tensor, scores_out: torch.Tensor, totals_out: torch.Tensor, *,
                  block_size: int, sink_blocks: int, local_blocks: int,
                  keys_out: torch.Tensor | None = None, tile: int = 512) -> torch.Tensor:
    """Group-max approximate mass shares (the rank score) and each query head's approximate total.

    Args:
      mass: ``[batch, num_kv_heads, group, num_cols]`` fp32 from :func:`sketch_block_mass`.
      seq_lens: ``[batch]`` int32.
      scores_out: ``[batch, num_kv_heads, num_cols]`` fp32 (last dim contiguous): ``max_g (mass_g(b) - T_g)``,
        ``+inf`` for the first ``sink_blocks`` and last ``local_blocks`` blocks, ``-inf`` past the end.
      totals_out: ``[batch * num_kv_heads * group]`` fp32: ``T_g = log2 sum_b 2^mass_g(b)``.
      keys_out: optional int16 order-preserving keys of ``scores_out`` (same shape and strides).
    One launch of ``batch * num_kv_heads`` programs, each reading its row twice; no allocation.
    """
    batch, num_kv_heads, group, num_cols = mass.shape
    if batch == 0 or num_cols == 0:
        return scores_out
    assert mass.stride(3) == 1 and scores_out.stride(2) == 1 and totals_out.is_contiguous()
    if keys_out is not None:
        assert keys_out.dtype == torch.int16 and keys_out.stride() == scores_out.stride()
    _shares_kernel[(batch * num_kv_heads,)](
        mass, mass.stride(0), mass.stride(1), mass.stride(2), seq_lens,
        scores_out, scores_out.stride(0), scores_out.stride(1),
        keys_out if keys_out is not None else scores_out, totals_out,
        num_cols, sink_blocks, local_blocks,
        NUM_KV_HEADS=num_kv_heads, GROUP=group, G_PAD=triton.next_power_of_2(group), BLOCK_SIZE=block_size,
        TILE=min(tile, triton.next_power_of_2(max(num_cols, 16))), WRITE_KEYS=keys_out is not None,
    )
    return scores_out


def sketch_scores_reference(q, k_buffer, req_to_token, req_pool_indices, seq_lens, *, block_size, sm_scale,
                            num_blocks, sink_blocks, local_blocks):
    """fp32 reference of the two sketch passes from the keys themselves (quantized here).

    Returns ``(scores [batch, num_kv_heads, num_blocks], totals [batch, num_qo_heads], mass [batch, num_kv_heads,
    group, num_blocks])``: shares as :func:`sketch_shares` writes them, ``T_g`` per query head, block masses.
    """
    batch, num_qo_heads, _ = q.shape
    num_kv_heads = k_buffer.shape[1]
    group = num_qo_heads // num_kv_heads
    scores = torch.full((batch, num_kv_heads, num_blocks), float("-inf"))
    totals = torch.full((batch, num_qo_heads), float("-inf"))
    mass = torch.full((batch, num_kv_heads, group, num_blocks), float("-inf"))
    sl2 = sm_scale * LOG2E
    for r in range(batch):
        n = int(seq_lens[r])
        nb = -(-n // block_size)
        slots = req_to_token[int(req_pool_indices[r]), :n].long().cpu()
        codes, sc = quantize_keys_reference(k_buffer.index_select(0, slots.to(k_buffer.device)).cpu())
        ks = dequantize_reference(codes, sc)  # [n, H, d]
        for h in range(num_kv_heads):
            x = (q[r, h * group:(h + 1) * group].float().cpu() @ ks[:, h].T) * sl2  # [G, n]
            pad = torch.full((group, nb * block_size - n), float("-inf"))
            lm = torch.logsumexp(torch.cat([x, pad], 1).view(group, nb, block_size) / LOG2E, -1) * LOG2E
            mass[r, h, :, :nb] = lm
            tot = torch.logsumexp(lm / LOG2E, -1) * LOG2E
            totals[r, h * group:(h + 1) * group] = tot
            s = (lm - tot[:, None]).amax(0)
            b = torch.arange(nb)
            s = torch.where((b < sink_blocks) | (b >= nb - local_blocks), torch.full_like(s, float("inf")), s)
            scores[r, h, :nb] = s
    return scores, totals, mass


class KeySketchPool:
    """The int4 key sketch of every layer, per block row (the rows of a :class:`BlockMetaPool`).

    ``codes`` ``[num_layers, num_rows, num_kv_heads, block_size, head_dim // 2]`` uint8 and ``scales``
    ``[num_layers, num_rows, num_kv_heads, block_size]`` fp16. Same interface as
    :class:`flashinfer_ext.psa.block_meta.BlockMetaPool` (:meth:`layer`, :meth:`update`, :meth:`rebuild_pages`).
    """

    def __init__(self, num_layers: int, num_rows: int, num_kv_heads: int, head_dim: int, block_size: int,
                 device: str | torch.device = "cpu"):
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size={block_size} must be a power of two")
        if head_dim % 2:
            raise ValueError(f"head_dim={head_dim} must be even for the int4 key sketch")
        self.block_size = block_size
        self.num_rows = int(num_rows)
        self.codes = torch.full((num_layers, num_rows, num_kv_heads, block_size, head_dim // 2), 136,
                                dtype=torch.uint8, device=device)
        self.scales = torch.zeros((num_layers, num_rows, num_kv_heads, block_size), dtype=torch.float16,
                                  device=device)

    def nbytes(self) -> int:
        return self.codes.numel() + 2 * self.scales.numel()

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(codes, scales)`` of one layer (views)."""
        return self.codes[layer_id], self.scales[layer_id]

    def update(self, layer_id: int, k_buffer: torch.Tensor, req_to_token: torch.Tensor,
               req_pool_indices: torch.Tensor, block_table: torch.Tensor,
               start_pos: torch.Tensor, end_pos: torch.Tensor, max_new_blocks: int) -> None:
        """:func:`update_key_sketch` on layer ``layer_id``."""
        codes, scales = self.layer(layer_id)
        update_key_sketch(k_buffer, codes, scales, req_to_token, req_pool_indices, block_table, start_pos, end_pos,
                          block_size=self.block_size, max_new_blocks=max_new_blocks)

    def rebuild_pages(self, layer_id: int, k_buffer: torch.Tensor, pages: torch.Tensor) -> None:
        """Page size = block size: re-quantize whole pages ``pages`` (int64 ``[n]``, device) from the keys in them."""
        p = self.block_size
        n = k_buffer.shape[0] // p
        kp = k_buffer[: n * p].view(n, p, k_buffer.shape[1], k_buffer.shape[2]).index_select(0, pages)
        codes, sc = quantize_keys_reference(kp.transpose(1, 2))  # [n_pages, H, P, d]
        half = codes.shape[-1] // 2
        u = (codes[..., :half].to(torch.int32) + 8) | ((codes[..., half:].to(torch.int32) + 8) << 4)
        self.codes[layer_id].index_copy_(0, pages, u.to(torch.uint8))
        self.scales[layer_id].index_copy_(0, pages, sc)
