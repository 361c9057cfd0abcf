"""PSA's key sketch: every key kept a second time as int4, to rank blocks and drive the stop test.

Supports: a per-token int4 copy of one layer's keys, stored per block row beside the KV pool
(:class:`KeySketchPool`: ``codes`` ``[num_rows, num_kv_heads, block_size, head_dim // 2]`` uint8 and
``scales`` ``[num_rows, num_kv_heads, block_size]`` fp16, i.e. ``head_dim / 2 + 2`` bytes per token and KV
head), written at the same points as PSA's block metadata (:func:`update_key_sketch`, ranges of positions
through a block table), and the two passes of the sketch stop test:

* :func:`sketch_block_mass`: per (request, KV head, query head of the group, block) the base-2 log of the
  block's approximate softmax numerator ``sum_t 2^(scale_log2 * q . k_sketch_t)`` (one Triton launch, bf16 / fp16
  queries, tensor-core dots over the codes dequantized to the query dtype: exact, they are small integers);
* :func:`sketch_shares`: per (request, KV head) the base-2 log of each query head's total approximate mass
  ``T_g``, and per block the group max of the approximate mass *shares* ``max_g (lm_g(b) - T_g)`` (``+inf`` for
  sink / local blocks, ``-inf`` past the end) with its order-preserving int16 sort key.

The stop test then ranks blocks by the share and sets, for query head ``g`` after ``e`` ranks read, the unread
mass to ``R_g(e) = 2^(T_g + calib_slack) * sum_{rank >= e} 2^share`` (a suffix sum from
:func:`flashinfer_ext.psa.criticality.bound_suffix`), which is at least head ``g``'s own approximate unread mass.

Quantization: symmetric int4 with one scale per (token, KV head): ``scale = fp16(max(|k|) / 7)`` (at least
``1e-4``), ``code = clamp(floor(k / scale + 0.5), -7, 7)``; byte ``j`` of a token holds dimension ``j`` in its low
nibble and dimension ``j + head_dim / 2`` in its high nibble, each as ``code + 8``.

Launch shape of :func:`sketch_block_mass`: grid ``[batch * num_kv_heads, ceil(num_cols / tile_b)]``, 4 warps; a
program walks its ``tile_b`` blocks in sub-tiles of ~16 KiB of codes (512 tokens at ``head_dim`` 64, read as int32
words), each one two ``tl.dot`` (low / high nibbles) of ``[U * G_COLS, U * head_dim / 2]`` queries, block-diagonal
over ``U`` consecutive tokens folded into a dot column (``U = 4`` for groups of 3-4: 12-16 of the 16 rows real),
by ``[U * head_dim / 2, sub-tile tokens / U]`` codes, then a per-(query head, block) log-sum-exp.

Cautions: the sketch is an estimate, not a bound: a block whose int4 logits are far below its real ones can
be left unread (``calib_slack`` is the margin). ``head_dim`` must be even. Requires ``block_size`` a power of two.
On the GPU the nibbles are decoded by inline PTX (sm_80 or newer); under the CPU interpreter they are decoded
arithmetically and the dots run in fp32 (the interpreter mis-computes bf16 dots).
"""

from __future__ import annotations

import os

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
def _nibble_pair(w, IS_BF16: tl.constexpr, DOT_FP32: tl.constexpr):
    """Codes (nibble - 8) in bits 0-3 and 16-19 of int32 words ``w``, as two tensors of the dot's input dtype: on the
    GPU one ``lop3`` puts the nibbles under the exponent of 128 (bf16) / 1024 (fp16) and one packed op takes off 136 /
    1032 (exact, no int->float conversion); the interpreter decodes to fp32 arithmetically."""
    if DOT_FP32:
        return ((w & 15) - 8).to(tl.float32), (((w >> 16) & 15) - 8).to(tl.float32)
    elif IS_BF16:
        return tl.inline_asm_elementwise(
            "{.reg .b32 t, o, m; lop3.b32 t, $2, 0x000F000F, 0x43004300, 0xEA; mov.b32 o, 0x3F803F80; "
            "mov.b32 m, 0xC308C308; fma.rn.bf16x2 t, t, o, m; mov.b32 {$0, $1}, t;}",
            "=h,=h,r", [w], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise(
            "{.reg .b32 t, m; lop3.b32 t, $2, 0x000F000F, 0x64006400, 0xEA; mov.b32 m, 0x64086408; "
            "sub.f16x2 t, t, m; mov.b32 {$0, $1}, t;}",
            "=h,=h,r", [w], dtype=(tl.float16, tl.float16), is_pure=True, pack=1)


@triton.jit
def _join2(a, b, R: tl.constexpr, C: tl.constexpr):
    """``[R, C]`` x 2 -> ``[R, 2C]`` interleaved: column ``2c + s`` = (a, b)[s][:, c]."""
    return tl.reshape(tl.join(a, b), [R, 2 * C])


@triton.jit
def _dequant_tile(wd, TOK: tl.constexpr, WP: tl.constexpr, PACK: tl.constexpr, IS_BF16: tl.constexpr,
                  DOT_FP32: tl.constexpr):
    """Packed codes ``[TOK, WP]`` -> ``(c_lo, c_hi)`` ``[TOK, PACK * WP]``: dims ``j`` / ``j + HALF`` in column j."""
    if PACK == 4:  # int32 words: byte i of word w = dims 4w + i (low nibble) and HALF + 4w + i (high nibble)
        a0, b0 = _nibble_pair(wd, IS_BF16, DOT_FP32)  # dims 4w, 4w + 2
        a1, b1 = _nibble_pair(wd >> 8, IS_BF16, DOT_FP32)  # 4w + 1, 4w + 3
        a2, b2 = _nibble_pair(wd >> 4, IS_BF16, DOT_FP32)  # the same four, high nibbles
        a3, b3 = _nibble_pair(wd >> 12, IS_BF16, DOT_FP32)
        c_lo = _join2(_join2(a0, b0, TOK, WP), _join2(a1, b1, TOK, WP), TOK, 2 * WP)
        c_hi = _join2(_join2(a2, b2, TOK, WP), _join2(a3, b3, TOK, WP), TOK, 2 * WP)
    else:  # bytes (HALF not a multiple of 4)
        dt: tl.constexpr = tl.float32 if DOT_FP32 else (tl.bfloat16 if IS_BF16 else tl.float16)
        c_lo, c_hi = ((wd.to(tl.int32) & 15) - 8).to(dt), ((wd.to(tl.int32) >> 4) - 8).to(dt)
    return c_lo, c_hi


@triton.jit
def _block_mass_kernel(
    q_ptr, stride_qb, stride_qh,
    codes_ptr, stride_c_row, stride_c_head, scales_ptr, stride_s_row, stride_s_head,
    block_table_ptr, stride_bt, seq_lens_ptr,
    mass_ptr, stride_mb, stride_mh, stride_mg, num_cols, scale_log2,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, G_COLS: tl.constexpr, U: tl.constexpr,
    HALF: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, PACK: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_B: tl.constexpr, SUB_B: tl.constexpr, IS_BF16: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    pair, r, h, r64, seq_len, n_blocks = _pair_blocks(seq_lens_ptr, NUM_KV_HEADS, BLOCK_SIZE)
    n_blocks = tl.minimum(n_blocks, num_cols)
    SUB_TOK: tl.constexpr = SUB_B * BLOCK_SIZE
    M: tl.constexpr = SUB_TOK // U  # dot columns: U consecutive tokens each
    BU: tl.constexpr = BLOCK_SIZE // U
    HP: tl.constexpr = PACK * WP  # half dims per token, padded
    KU: tl.constexpr = U * HP
    N: tl.constexpr = U * G_COLS
    b0 = tl.program_id(1) * TILE_B
    m_base = mass_ptr + r64 * stride_mb + h * stride_mh
    gg, nn, kk = tl.arange(0, G_COLS), tl.arange(0, N), tl.arange(0, KU)
    # queries, block-diagonal over the U token slots: row (u, g), column (u', j) = q_g[j] if u' == u
    qmask = ((nn // G_COLS)[:, None] == (kk // HP)[None, :]) & ((nn % G_COLS) < GROUP)[:, None] & \
        ((kk % HP) < HALF)[None, :]
    q_ptrs = q_ptr + r64 * stride_qb + (h * GROUP + nn % G_COLS)[:, None] * stride_qh + (kk % HP)[None, :]
    q_lo = tl.load(q_ptrs, mask=qmask, other=0.0)
    q_hi = tl.load(q_ptrs + HALF, mask=qmask, other=0.0)
    if DOT_FP32:
        q_lo, q_hi = q_lo.to(tl.float32), q_hi.to(tl.float32)
    tok, wi = tl.arange(0, SUB_TOK), tl.arange(0, WP)
    # token (u, block, mm) of the [U, 1, SUB_B, BU] logits view: (block * BU + mm) * U + u
    pos4 = (tl.arange(0, SUB_B)[None, None, :, None] * BU + tl.arange(0, BU)[None, None, None, :]) * U + \
        tl.arange(0, U)[:, None, None, None]
    n_iter = tl.minimum(tl.maximum(tl.cdiv(n_blocks - b0, SUB_B), 0), TILE_B // SUB_B)
    for i in tl.range(0, n_iter, num_stages=1):  # no cp.async pipelining: it made this loop slower on the H200
        bs0 = b0 + i * SUB_B
        b, t = bs0 + tok // BLOCK_SIZE, tok % BLOCK_SIZE
        ok = b < n_blocks
        rows = tl.load(block_table_ptr + r64 * stride_bt + b, mask=ok, other=0).to(tl.int64)
        if WP == W:
            wmask = ok[:, None]
        else:
            wmask = ok[:, None] & (wi < W)[None, :]
        wd = tl.load(codes_ptr + rows[:, None] * stride_c_row + h * stride_c_head + t[:, None] * W + wi[None, :],
                     mask=wmask, other=0)
        sc = tl.load(scales_ptr + rows * stride_s_row + h * stride_s_head + t, mask=ok, other=0.0)
        c_lo, c_hi = _dequant_tile(wd, SUB_TOK, WP, PACK, IS_BF16, DOT_FP32)  # [SUB_TOK, HP] -> [M, KU] below
        acc = tl.dot(q_lo, tl.trans(tl.reshape(c_lo, [M, KU])))
        acc = tl.dot(q_hi, tl.trans(tl.reshape(c_hi, [M, KU])), acc)  # [N, M]: row (u, g), column m: q_g . k_{mU+u}
        x = tl.reshape(acc, [U, G_COLS, SUB_B, BU])
        sc4 = tl.reshape(tl.trans(tl.reshape(sc.to(tl.float32) * scale_log2, [M, U])), [U, 1, SUB_B, BU])
        x = tl.where(bs0 * BLOCK_SIZE + pos4 < seq_len, x * sc4, float("-inf"))
        mx = tl.max(tl.max(x, axis=3), axis=0)  # [G_COLS, SUB_B]
        mxs = tl.where(mx == float("-inf"), 0.0, mx)
        lm = tl.log2(tl.sum(tl.sum(tl.exp2(x - mxs[None, :, :, None]), axis=3), axis=0)) + mxs
        bb = bs0 + tl.arange(0, SUB_B)
        st_mask = (gg < GROUP)[:, None] & (bb < num_cols)[None, :]
        tl.store(m_base + gg[:, None] * stride_mg + bb[None, :], lm, mask=st_mask)
    for i in range(n_iter, TILE_B // SUB_B):  # sub-tiles past the end
        bb = b0 + i * SUB_B + tl.arange(0, SUB_B)
        tl.store(m_base + gg[:, None] * stride_mg + bb[None, :], tl.full([G_COLS, SUB_B], float("-inf"), tl.float32),
                 mask=(gg < GROUP)[:, None] & (bb < num_cols)[None, :])


def _block_mass_shape(group: int, head_dim: int, block_size: int, tile_b: int, sub_tok: int = 0) -> dict:
    """The launch constants of :func:`sketch_block_mass` (see its docstring)."""
    half = head_dim // 2
    pack = 4 if half % 4 == 0 else 1
    w, g_cols = half // pack, triton.next_power_of_2(group)
    u = max(1, min(16 // g_cols, block_size, 256 // (pack * triton.next_power_of_2(w))))
    g_cols = max(g_cols, 16 // u)
    wp = max(triton.next_power_of_2(w), -(-16 // (u * pack)))
    min_b = max(1, 16 * u // block_size)  # >= 16 dot columns
    sub_tok = sub_tok or min(1024, triton.next_power_of_2(max(16384 // max(half, 1), 1)))
    sub_b = max(min_b, sub_tok // block_size)
    tile_b = triton.next_power_of_2(max(tile_b or 4 * sub_b, min_b))
    return dict(G_COLS=g_cols, U=u, HALF=half, W=w, WP=wp, PACK=pack, BLOCK_SIZE=block_size, TILE_B=tile_b,
                SUB_B=min(sub_b, tile_b))


def sketch_block_mass(q: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, block_table: torch.Tensor,
                      seq_lens: torch.Tensor, mass_out: torch.Tensor, *, block_size: int, sm_scale: float,
                      tile_b: int = 0, sub_tokens: int = 0) -> torch.Tensor:
    """Base-2 log of every block's approximate softmax numerator, per query head.

    Args:
      q: ``[batch, num_qo_heads, head_dim]`` post-RoPE decode queries, bf16 or fp16.
      codes, scales: one layer's sketch (see :func:`update_key_sketch`).
      block_table: ``[batch, >= num_cols]`` int32 logical block -> sketch row; seq_lens: ``[batch]`` int32.
      mass_out: ``[batch, num_kv_heads, group, num_cols]`` fp32 (last dim contiguous): entry ``b`` =
        ``log2 sum_{t in block b} 2^(sm_scale * log2(e) * q_g . k_sketch_t)`` (``-inf`` past the end).
      tile_b: blocks per program (0: four sub-tiles), rounded up to a power of two and to >= 16 dot columns.
      sub_tokens: tokens per sub-tile (0: about 16 KiB of codes, at most 1024 tokens; a power of two).
    One launch over ``[batch * num_kv_heads, ceil(num_cols / tile_b)]``, 4 warps; no allocation, graph-capturable.
    """
    (batch, num_qo_heads, head_dim), num_kv_heads, num_cols = q.shape, codes.shape[1], mass_out.shape[3]
    group = num_qo_heads // num_kv_heads
    if batch == 0 or num_cols == 0:
        return mass_out
    assert mass_out.stride(3) == 1 and q.stride(2) == 1 and q.dtype in (torch.bfloat16, torch.float16)
    assert codes.stride(3) == 1 and codes.stride(2) == head_dim // 2 and scales.stride(2) == 1
    shape = _block_mass_shape(group, head_dim, block_size, tile_b, sub_tokens)
    if shape["PACK"] == 4:
        codes = codes.view(torch.int32)  # 4 bytes (8 dims) per load element; strides in words
    grid = (batch * num_kv_heads, triton.cdiv(num_cols, shape["TILE_B"]))
    _block_mass_kernel[grid](
        q, q.stride(0), q.stride(1),
        codes, codes.stride(0), codes.stride(1), scales, scales.stride(0), scales.stride(1),
        block_table, block_table.stride(0), seq_lens,
        mass_out, mass_out.stride(0), mass_out.stride(1), mass_out.stride(2), num_cols, float(sm_scale) * LOG2E,
        NUM_KV_HEADS=num_kv_heads, GROUP=group, IS_BF16=q.dtype == torch.bfloat16,
        DOT_FP32=os.environ.get("TRITON_INTERPRET", "0") == "1", num_warps=4, **shape,
    )
    return mass_out


@triton.jit
def head_totals(mass_ptr, stride_mb, stride_mh, stride_mg, seq_lens_ptr, tot_ptr, num_cols,
                NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                TILE: tl.constexpr):
    """Program axis 0 = (request, KV head) pair of a ``[batch, num_kv_heads, group, num_cols]`` mass row: each query
    head's total ``T_g = log2 sum_b 2^mass_g(b)`` stored to ``tot_ptr`` and returned for the shares.

    Returns ``(pair, r64, h, n_blocks, g, gmask, m_row, tot_s)``: ``m_row`` the ``[G_PAD, 1]`` row pointers, ``tot_s``
    the totals with ``-inf`` as 0 (no block)."""
    pair, r, h, r64, seq_len, n_blocks = _pair_blocks(seq_lens_ptr, NUM_KV_HEADS, BLOCK_SIZE)
    n_blocks = tl.minimum(n_blocks, num_cols)
    g = tl.arange(0, G_PAD)
    gmask = g < GROUP
    m_row = mass_ptr + r64 * stride_mb + h * stride_mh + g[:, None] * stride_mg
    run_m = tl.full([G_PAD], float("-inf"), tl.float32)
    run_s = tl.zeros([G_PAD], tl.float32)
    for c0 in range(0, n_blocks, TILE):
        b = c0 + tl.arange(0, TILE)
        x = tl.load(m_row + b[None, :], mask=gmask[:, None] & (b < n_blocks)[None, :], other=float("-inf"))
        new_m = tl.maximum(run_m, tl.max(x, axis=1))
        nms = tl.where(new_m == float("-inf"), 0.0, new_m)
        run_s = run_s * tl.exp2(run_m - nms) + tl.sum(tl.exp2(x - nms[:, None]), axis=1)
        run_m = new_m
    # an fp32 normal floor: a subnormal constant would type the expression fp64
    tot = tl.where(run_s > 0.0, tl.log2(tl.maximum(run_s, 1e-30)) + tl.where(run_m == float("-inf"), 0.0, run_m),
                   float("-inf"))
    tl.store(tot_ptr + pair.to(tl.int64) * GROUP + g, tot, mask=gmask)
    return pair, r64, h, n_blocks, g, gmask, m_row, tl.where(tot == float("-inf"), 0.0, tot)


@triton.jit
def _shares_kernel(
    mass_ptr, stride_mb, stride_mh, stride_mg, seq_lens_ptr,
    scores_ptr, stride_sb, stride_sh, keys_ptr, tot_ptr,
    num_cols, sink_blocks, local_blocks,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr, WRITE_KEYS: tl.constexpr,
):
    pair, r64, h, n_blocks, g, gmask, m_row, tot_s = head_totals(
        mass_ptr, stride_mb, stride_mh, stride_mg, seq_lens_ptr, tot_ptr, num_cols, NUM_KV_HEADS, GROUP, G_PAD,
        BLOCK_SIZE, TILE)
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
