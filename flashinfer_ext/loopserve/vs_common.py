"""Shared pieces of the vertical / slash line estimators (:mod:`flashinfer_ext.loopserve.vs_estimate`, one request;
:mod:`flashinfer_ext.loopserve.vs_estimate_batched`, a batch; :mod:`flashinfer_ext.loopserve.vs_lse_split`, the key-split LSE pass):
the Triton helpers that load a row block's queries and walk its keys (``_load_q``, ``_scores``, ``_rows_ml``,
``_rows_lse``) and the host-side launch parameters.

Supports GQA (any group size), head_dim up to 256, bf16/fp16 keys and queries in SGLang's layout
``k_buffer [num_slots, num_kv_heads, head_dim]`` reached through a request's token slots. Cautions: as the
estimators' (positions distinct, keys causal to each row's position).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _load_q(q_ptr, stride_qr, stride_qh, h, r0, R, GROUP: tl.constexpr, G_PAD: tl.constexpr,
            BLOCK_R: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
    """Rows packed g-major: row ``i`` is query head ``h*GROUP + i // BLOCK_R`` of sample ``r0 + i % BLOCK_R``."""
    i = tl.arange(0, G_PAD * BLOCK_R)
    g = i // BLOCK_R
    r = r0 + i % BLOCK_R
    d = tl.arange(0, D_PAD)
    rvalid = (g < GROUP) & (r < R)
    q = tl.load(q_ptr + r.to(tl.int64)[:, None] * stride_qr + (h * GROUP + g)[:, None] * stride_qh + d[None, :],
                mask=rvalid[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
    return q, g, r, rvalid


@triton.jit
def _scores(q, k_ptr, stride_ks, stride_kh, h, slot, kvalid, sm_scale_log2,
            HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, DOT_FP32: tl.constexpr):
    d = tl.arange(0, D_PAD)
    k = tl.load(k_ptr + slot[:, None] * stride_ks + h * stride_kh + d[None, :],
                mask=kvalid[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
    if DOT_FP32:  # the Triton CPU interpreter mis-computes bf16 tl.dot: emulate in fp32 there
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)))
    else:
        s = tl.dot(q.to(k.dtype), tl.trans(k))
    return s * sm_scale_log2


@triton.jit
def _rows_ml(q, pos, k_ptr, stride_ks, stride_kh, h, slots_ptr, sm_scale_log2, k_lo, k_hi, ROWS: tl.constexpr,
             BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, DOT_FP32: tl.constexpr):
    """Running base-2 max ``m`` and sum ``l`` (``[ROWS]`` each, flash-style) of packed query rows ``q`` at
    positions ``pos`` (-1: padding row) over the causal keys in ``[k_lo, k_hi)`` of ``slots_ptr``; a row
    with no key in the range gives ``(-inf, 0)``. ``k_lo`` must be a multiple of ``BLOCK_N``."""
    hi = tl.minimum(tl.max(pos, axis=0) + 1, k_hi)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    for n0 in range(k_lo, hi, BLOCK_N):
        kp = n0 + tl.arange(0, BLOCK_N)
        kvalid = kp < hi
        slot = tl.load(slots_ptr + kp, mask=kvalid, other=0).to(tl.int64)
        s = _scores(q, k_ptr, stride_ks, stride_kh, h, slot, kvalid, sm_scale_log2, HEAD_DIM, D_PAD, DOT_FP32)
        s = tl.where(kvalid[None, :] & (kp[None, :] <= pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp2(m_i - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), axis=1)
        m_i = m_new
    return m_i, l_i


@triton.jit
def _rows_lse(q, pos, k_ptr, stride_ks, stride_kh, h, slots_ptr, sm_scale_log2, ROWS: tl.constexpr,
              BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, DOT_FP32: tl.constexpr):
    """Base-2 log-sum-exp ``[ROWS]`` of packed query rows ``q`` at positions ``pos`` (-1: padding row,
    gives ``+inf``) over the causal keys of ``slots_ptr`` (flash-style running max / sum)."""
    m_i, l_i = _rows_ml(q, pos, k_ptr, stride_ks, stride_kh, h, slots_ptr, sm_scale_log2, 0, 1 << 62, ROWS,
                        BLOCK_N, HEAD_DIM, D_PAD, DOT_FP32)
    return tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("inf"))


def check_heads(num_qo_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """Validate the head layout (GQA group, head_dim <= 256); returns the group size."""
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"num_qo_heads={num_qo_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if head_dim > 256:
        raise ValueError(f"head_dim={head_dim} is out of range: expected <= 256")
    return num_qo_heads // num_kv_heads


def target_programs_of(device: torch.device) -> int:
    """About two waves of programs on ``device``: 2 x its SM count on CUDA (host query, no sync), 8 elsewhere."""
    device = torch.device(device)
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def launch_meta(group: int, head_dim: int, block_r: int, block_n: int) -> dict:
    """Compile-time parameters shared by the estimation kernels (``BLOCK_R`` raised so that
    ``G_PAD * BLOCK_R >= 16``, the smallest ``tl.dot`` tile; fp32 dots under the interpreter)."""
    g_pad = triton.next_power_of_2(group)
    return dict(GROUP=group, G_PAD=g_pad, BLOCK_R=max(block_r, 16 // g_pad), BLOCK_N=block_n, HEAD_DIM=head_dim,
                D_PAD=max(16, triton.next_power_of_2(head_dim)),
                DOT_FP32=os.environ.get("TRITON_INTERPRET", "0") == "1")
