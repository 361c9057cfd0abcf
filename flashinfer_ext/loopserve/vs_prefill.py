"""Vertical/slash sparse prefill attention for one extend segment (LoopServe Alg. 2's consumer), Triton.

Supports: one request per call, one layer; the extend tokens at query positions
``[prefix_len, seq_len)`` (a whole segment or one chunk of SGLang's chunked prefill: keys are
ALL positions ``0..seq_len-1`` in the pool, so a chunk attends over every earlier key and two
chunks give exactly one chunk's result with the same line sets); SGLang's KV layout
``[num_slots, num_kv_heads, head_dim]`` through ``token_slots = req_to_token[req_pool_idx]``;
GQA (the whole query-head group of a KV head shares one program and one key read); head_dim up
to 256; bf16/fp16. One launch, grid ``[num_kv_heads, query blocks]``.

Mask (per KV head ``h``): query position ``t`` attends key ``k`` iff ``k <= t`` and (``k`` is a
selected vertical OR ``t - k`` a selected slash offset). Sinks and the local window are part of
the line sets (``vs_select`` always adds them). Each entry is computed exactly once:
  * phase A gathers the selected vertical columns (``v_idx``, ascending; only those ``<=`` the
    block's last query, found by ``searchsorted`` before the launch) into dense tiles and masks
    out entries whose offset is a selected slash (phase B computes those);
  * phase B computes only the key blocks that a selected slash band crosses, masking to the exact
    diagonals: it walks down from the diagonal block, and the smallest selected offset ``>= d``
    (``s_next``, a suffix minimum over the slash bitmap, one load) tells whether a block is crossed
    and, if not, which block the next band starts in, so a query block costs O(crossed blocks) rather than a test per causal key block (at
    128k, 16-token query blocks x up to 2048 dependent loads).
Outputs ``o [T, num_qo_heads, head_dim]`` and a BASE-2 ``lse [T, num_qo_heads]``
(FlashInfer's ``return_lse`` convention: mergeable with ``flashinfer.merge_state``).

Cautions:
  * phase B computes whole ``BLOCK_Q x BLOCK_N`` tiles for every crossed band and masks; scattered
    slash offsets therefore cost up to two key blocks each per query block.
  * a query whose mask is empty (no offset 0 selected, no vertical ``<=`` it) gets ``o = 0``,
    ``lse = -inf``.
  * batching several requests per launch (varlen ``qo_indptr``) is not implemented yet.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from flashinfer_ext.common.tile_attention import attend_slots

__all__ = ["vs_prefill", "launch_shape"]


def launch_shape(head_dim: int) -> tuple[int, int | None, int | None]:
    """Default ``(block_n, num_warps, num_stages)`` for a head_dim (None: Triton's own default).

    head_dim <= 64: 32-key tiles, 4 warps, no software pipelining, picked by ``bench/vs_prefill_sweep.py`` over
    36 shapes on the 32k testbed's real attention (SmolLM2, 9/3 heads, d 64, H200): 1.42x faster than 64-key tiles
    with Triton's defaults (``bench/results/vs_prefill_sweep_h200.md``). Larger head dims keep 64-key tiles and
    Triton's defaults (not swept).
    """
    return (32, 4, 1) if head_dim <= 64 else (64, None, None)


@triton.jit
def _vs_prefill_kernel(
    q_ptr, stride_qt, stride_qh, k_ptr, stride_ks, stride_kh, v_ptr, stride_vs, stride_vh, slots_ptr,
    prefix_len, seq_len, vsorted_ptr, stride_vsh, vend_ptr, stride_veh, sflag_ptr, stride_sfh, snext_ptr, stride_snh,
    o_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, sm_scale_log2,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, DOT_FP32: tl.constexpr,
):
    h = tl.program_id(0)
    qb = tl.program_id(1)
    T = seq_len - prefix_len
    # rows packed token-major: row i is token qb*BLOCK_Q + i // G_PAD, query head h*GROUP + i % G_PAD
    i = tl.arange(0, BLOCK_Q * G_PAD)
    t = qb * BLOCK_Q + i // G_PAD
    g = i % G_PAD
    rvalid = (t < T) & (g < GROUP)
    pos = (prefix_len + t).to(tl.int64)
    d = tl.arange(0, D_PAD)
    dmask = d < HEAD_DIM
    qmask = rvalid[:, None] & dmask[None, :]
    q = tl.load(q_ptr + t.to(tl.int64)[:, None] * stride_qt + (h * GROUP + g)[:, None] * stride_qh + d[None, :],
                mask=qmask, other=0.0).to(k_ptr.dtype.element_ty)
    q_lo = prefix_len + qb * BLOCK_Q
    q_hi = tl.minimum(q_lo + BLOCK_Q, seq_len) - 1
    m_i = tl.full([BLOCK_Q * G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * G_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * G_PAD, D_PAD], tl.float32)
    sflag_row = sflag_ptr + h * stride_sfh
    snext_row = snext_ptr + h * stride_snh

    # phase A: selected vertical columns <= q_hi, minus entries lying on a selected slash
    v_hi = tl.load(vend_ptr + h * stride_veh + qb)
    for j0 in range(0, v_hi, BLOCK_N):
        jj = j0 + tl.arange(0, BLOCK_N)
        jvalid = jj < v_hi
        kp = tl.load(vsorted_ptr + h * stride_vsh + jj, mask=jvalid, other=0).to(tl.int64)
        slot = tl.load(slots_ptr + kp, mask=jvalid, other=0).to(tl.int64)
        off = pos[:, None] - kp[None, :]
        ok = rvalid[:, None] & jvalid[None, :] & (off >= 0)
        on_s = tl.load(sflag_row + off, mask=ok, other=0)
        ok = ok & (on_s == 0)
        m_i, _, l_i, acc, _ = attend_slots(q, k_ptr, v_ptr, stride_ks, stride_kh, stride_vs, stride_vh, h, slot,
                                           jvalid, ok, d, dmask, m_i, l_i, acc, sm_scale_log2, DOT_FP32)

    # phase B: the key blocks crossed by a selected slash band, exact diagonals, each block once, walking
    # down from the diagonal block and jumping over blocks no band crosses (snext: smallest selected
    # offset >= d, per KV head), so the work is O(crossed blocks), not O(causal key blocks)
    b = q_hi // BLOCK_N
    while b >= 0:
        n0 = b * BLOCK_N
        k_hi = tl.minimum(n0 + BLOCK_N - 1, q_hi)
        s_next = tl.load(snext_row + tl.maximum(q_lo - k_hi, 0))  # offsets crossing block b: [q_lo - k_hi, q_hi - n0]
        if s_next <= q_hi - n0:
            kp = n0 + tl.arange(0, BLOCK_N)
            kvalid = kp <= k_hi
            slot = tl.load(slots_ptr + kp, mask=kvalid, other=0).to(tl.int64)
            off = pos[:, None] - kp[None, :]
            ok = rvalid[:, None] & kvalid[None, :] & (off >= 0)
            on_s = tl.load(sflag_row + off, mask=ok, other=0)
            ok = ok & (on_s != 0)
            m_i, _, l_i, acc, _ = attend_slots(q, k_ptr, v_ptr, stride_ks, stride_kh, stride_vs, stride_vh, h, slot,
                                               kvalid, ok, d, dmask, m_i, l_i, acc, sm_scale_log2, DOT_FP32)
            b = b - 1
        else:  # the next block down that offset s_next crosses holds key q_hi - s_next (none: done)
            b = tl.where(s_next <= q_hi, (q_hi - s_next) // BLOCK_N, -1)

    has = l_i > 0.0
    l_safe = tl.where(has, l_i, 1.0)
    o = acc / l_safe[:, None]
    lse = tl.where(has, m_i + tl.log2(l_safe), float("-inf"))
    qh = h * GROUP + g
    tl.store(o_ptr + t.to(tl.int64)[:, None] * stride_ot + qh[:, None] * stride_oh + d[None, :],
             o.to(o_ptr.dtype.element_ty), mask=qmask)
    tl.store(lse_ptr + t.to(tl.int64) * stride_lt + qh, lse, mask=rvalid)


def vs_prefill(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, token_slots: torch.Tensor, *,
               prefix_len: int, seq_len: int, v_idx: torch.Tensor, v_cnt: torch.Tensor, s_idx: torch.Tensor,
               s_cnt: torch.Tensor, sm_scale: float, out: torch.Tensor | None = None,
               lse_out: torch.Tensor | None = None, block_m: int = 64, block_n: int | None = None,
               num_warps: int | None = None, num_stages: int | None = None):
    """Sparse attention of the extend tokens over the selected vertical + slash lines.

    Args:
      q: ``[T, num_qo_heads, head_dim]`` post-RoPE queries of positions ``prefix_len..seq_len-1``
        (``T = seq_len - prefix_len``); cast to the KV dtype.
      k_buffer, v_buffer: ``[num_slots, num_kv_heads, head_dim]`` bf16/fp16, one layer, holding
        every position ``< seq_len`` of the request (this segment's keys already written).
      token_slots: ``[>= seq_len]`` int32/int64 (``req_to_token[req_pool_idx]``).
      prefix_len, seq_len: host ints.
      v_idx: ``[num_kv_heads, W]`` int key positions, the first ``v_cnt[h]`` ascending and ``< seq_len``;
      s_idx: ``[num_kv_heads, W']`` int slash offsets, the first ``s_cnt[h]`` distinct and ``< seq_len``
        (e.g. :class:`flashinfer_ext.loopserve.vs_select.VSSelection`; lines selected for a longer
        sequence are fine as long as the entries used are ``< seq_len``).
      v_cnt, s_cnt: ``[num_kv_heads]`` int counts.
      out: ``[T, num_qo_heads, head_dim]`` (default q's dtype); lse_out ``[T, num_qo_heads]`` fp32 base 2.
      block_m, block_n: query rows (tokens x the padded query-head group) and keys per tile (powers of two).
      num_warps, num_stages: Triton launch options. ``block_n``, ``num_warps`` and ``num_stages`` left None take
        :func:`launch_shape` of the head_dim; the result does not depend on them beyond fp32 summation order.
    Returns ``(out, lse_out)``. A few small torch ops (bitmap, prefix count, searchsorted) then one
    launch; no host sync.
    """
    t_len, hq, d = q.shape
    hk = k_buffer.shape[1]
    if hq % hk:
        raise ValueError(f"num_qo_heads={hq} is not a multiple of num_kv_heads={hk}")
    if not 0 <= prefix_len <= seq_len or t_len != seq_len - prefix_len:
        raise ValueError(f"q has {t_len} tokens; expected seq_len - prefix_len = {seq_len} - {prefix_len}")
    if d > 256:
        raise ValueError(f"head_dim={d} is out of range: expected <= 256")
    dev = q.device
    if out is None:
        out = torch.empty(t_len, hq, d, dtype=q.dtype, device=dev)
    if lse_out is None:
        lse_out = torch.empty(t_len, hq, dtype=torch.float32, device=dev)
    if t_len == 0:
        return out, lse_out
    assert q.stride(2) == 1 and k_buffer.stride(2) == 1 and v_buffer.stride(2) == 1 and out.stride(2) == 1
    group = hq // hk
    g_pad = triton.next_power_of_2(group)
    shape_n, shape_w, shape_s = launch_shape(d)
    block_n = shape_n if block_n is None else block_n
    num_warps = shape_w if num_warps is None else num_warps
    num_stages = shape_s if num_stages is None else num_stages
    block_q = max(1, block_m // g_pad)
    n_qb = triton.cdiv(t_len, block_q)
    big = torch.iinfo(torch.int32).max
    # verticals: ascending, padded with +inf so searchsorted finds each query block's prefix
    wv = v_idx.shape[1]
    jv = torch.arange(wv, device=dev)
    v_sorted = torch.where(jv[None, :] < v_cnt[:, None].long(), v_idx.to(torch.int32), big).contiguous()
    q_hi = prefix_len + torch.clamp((torch.arange(n_qb, device=dev) + 1) * block_q, max=t_len) - 1
    v_end = torch.searchsorted(v_sorted, q_hi.to(torch.int32).expand(hk, n_qb).contiguous(), right=True)
    v_end = v_end.to(torch.int32).contiguous()
    # slashes: bitmap over offsets and its exclusive prefix count
    ws = s_idx.shape[1]
    js = torch.arange(ws, device=dev)
    s_pos = torch.where(js[None, :] < s_cnt[:, None].long(), s_idx.long(), seq_len).clamp(max=seq_len)
    s_flag = torch.zeros(hk, seq_len + 1, dtype=torch.int8, device=dev).scatter_(1, s_pos, 1)
    s_flag[:, seq_len] = 0
    # s_next[h, d]: the smallest selected offset >= d (big: none), a suffix minimum over the bitmap
    ar = torch.arange(seq_len + 1, device=dev, dtype=torch.int32)
    s_next = torch.where(s_flag != 0, ar, big).flip(1).cummin(1).values.flip(1).contiguous()
    _vs_prefill_kernel[(hk, n_qb)](
        q, q.stride(0), q.stride(1), k_buffer, k_buffer.stride(0), k_buffer.stride(1),
        v_buffer, v_buffer.stride(0), v_buffer.stride(1), token_slots, prefix_len, seq_len,
        v_sorted, v_sorted.stride(0), v_end, v_end.stride(0), s_flag, s_flag.stride(0), s_next, s_next.stride(0),
        out, out.stride(0), out.stride(1), lse_out, lse_out.stride(0), float(sm_scale) / math.log(2.0),
        GROUP=group, G_PAD=g_pad, BLOCK_Q=block_q, BLOCK_N=block_n, HEAD_DIM=d,
        D_PAD=max(16, triton.next_power_of_2(d)), DOT_FP32=os.environ.get("TRITON_INTERPRET", "0") == "1",
        **{k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages)) if v is not None},
    )
    return out, lse_out
