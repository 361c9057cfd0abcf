"""Vertical / slash line estimation from sampled query rows (LoopServe Alg. 2, lines 1-5), Triton.

Supports: one request per call, one layer; sampled query rows of the new segment at distinct
absolute positions (any subset of ``[0, seq_len)``, e.g. the extend tokens of the current chunk,
always including the last ones); keys of ALL positions ``0..seq_len-1`` of the request in
SGLang's layout ``k_buffer [num_slots, num_kv_heads, head_dim]`` (post-RoPE) reached through
``token_slots = req_to_token[req_pool_idx]``; GQA (any group size, e.g. 4/1, 9/3); head_dim up to
256; bf16/fp16 keys and queries. Each sampled row attends causally (keys at positions ``<=`` its own).

Lines are per KV HEAD: the softmax attention of the G query heads of a group is summed, so one
line set serves the whole group in sparse prefill/decode (one key read per group, as the issue's
"per-KV-head masks"). Outputs, each ``[num_kv_heads, seq_len]`` fp32:
  * ``v_sum[h, k]``  mass of key position ``k`` (vertical line), ``v_max`` its largest entry;
  * ``s_sum[h, d]``  mass of the diagonal ``q_pos - k_pos = d`` (slash line), ``s_max`` its largest entry.
The maxima are the overlap bounds of Alg. 2's ``ol_s``/``ol_v`` (see ``vs_select``).

Two launches: ``_row_lse_kernel`` (grid ``[Hk, row blocks]``: base-2 log-sum-exp of every sampled
row and query head, flash-style) then ``_lines_kernel`` (grid ``[Hk, key blocks]``: normalised
probabilities, vertical sums reduced in registers, slash sums by fp32 atomics).

Cautions:
  * slash sums use ``tl.atomic_add`` / ``tl.atomic_max``: the fp32 summation order is not
    deterministic on the GPU (differences at fp32 rounding level); vertical sums are deterministic.
  * sampled positions must be distinct (a slash and a vertical then meet in at most one entry,
    which is what the overlap accounting of ``vs_select`` relies on); not checked (no host sync).
  * the key loop of a row block runs to the largest position in the block; pass rows sorted by
    position for the least wasted work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .vs_common import (_load_q, _rows_lse, _scores, check_heads, launch_meta,  # noqa: F401 (re-exported)
                        target_programs_of)
from .vs_lse_split import MIN_SPLIT_KEYS, lse_splits, split_lse

__all__ = ["VSLineSums", "vs_estimate", "sample_query_rows"]


@dataclass
class VSLineSums:
    """Per-KV-head line sums of one request, one layer (all ``[num_kv_heads, seq_len]`` fp32)."""

    v_sum: torch.Tensor
    v_max: torch.Tensor
    s_sum: torch.Tensor
    s_max: torch.Tensor
    group_size: int
    num_rows: int


def stack_line_sums(parts: "list[VSLineSums]") -> VSLineSums:
    """The line sums of several layers (same request, rows and length) as one ``[sum of num_kv_heads, seq_len]``
    :class:`VSLineSums`: :func:`flashinfer_ext.loopserve.vs_select.vs_select` then selects every layer's lines in
    one call (its work is per head row, so each layer gets the lines it would get alone)."""
    if not parts:
        raise ValueError("stack_line_sums needs at least one VSLineSums")
    g, r = parts[0].group_size, parts[0].num_rows
    if any(p.group_size != g or p.num_rows != r for p in parts):
        raise ValueError("stack_line_sums: the parts differ in group_size or num_rows")
    return VSLineSums(*(torch.cat([getattr(p, f) for p in parts]) for f in ("v_sum", "v_max", "s_sum", "s_max")),
                      g, r)


def sample_query_rows(extend_len: int, num_rows: int) -> torch.Tensor:
    """Local indices (int64, ascending, CPU) of the rows of an extend segment sampled for estimation.

    ``min(num_rows, extend_len)`` distinct rows: the last ``max(1, r // 2)`` (the question sits at
    the end of a turn) and the rest evenly spaced over the earlier part of the segment.
    """
    r = min(num_rows, extend_len)
    n_last = min(r, max(1, r // 2))
    rest = torch.linspace(0, extend_len - n_last - 1, r - n_last).round().long() if r > n_last else \
        torch.zeros(0, dtype=torch.long)
    return torch.unique(torch.cat([rest, torch.arange(extend_len - n_last, extend_len)]))


@triton.jit
def _group_probs(q, pos, rvalid, lse, k_ptr, stride_ks, stride_kh, h, slot, kp, kvalid, sm_scale_log2,
                 G_PAD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                 D_PAD: tl.constexpr, DOT_FP32: tl.constexpr):
    """Normalised causal probabilities of the packed rows on keys ``kp``, summed over the group's query
    heads: ``[BLOCK_R, BLOCK_N]`` fp32 (0 off the causal / valid range)."""
    s = _scores(q, k_ptr, stride_ks, stride_kh, h, slot, kvalid, sm_scale_log2, HEAD_DIM, D_PAD, DOT_FP32)
    ok = rvalid[:, None] & kvalid[None, :] & (kp[None, :] <= pos[:, None])
    p = tl.where(ok, tl.exp2(s - lse[:, None]), 0.0)
    return tl.sum(tl.reshape(p, (G_PAD, BLOCK_R, BLOCK_N)), axis=0)


# Arguments that follow the request's length are not specialized (a new prompt length must not compile a new binary:
# tests/flashinfer_ext/test_kernel_specialization.py): the row count, the context length, the strides of length-sized
# buffers, and the line-sum outputs, which are views of one allocation at length-sized offsets.
@triton.jit(do_not_specialize=["R", "stride_lh"])
def _row_lse_kernel(q_ptr, stride_qr, stride_qh, pos_ptr, R, k_ptr, stride_ks, stride_kh, slots_ptr,
                    lse_ptr, stride_lh, sm_scale_log2,
                    GROUP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, DOT_FP32: tl.constexpr):
    h = tl.program_id(0)
    r0 = tl.program_id(1) * BLOCK_R
    q, g, r, rvalid = _load_q(q_ptr, stride_qr, stride_qh, h, r0, R, GROUP, G_PAD, BLOCK_R, HEAD_DIM, D_PAD)
    pos = tl.load(pos_ptr + r, mask=rvalid, other=-1).to(tl.int64)
    lse = _rows_lse(q, pos, k_ptr, stride_ks, stride_kh, h, slots_ptr, sm_scale_log2, G_PAD * BLOCK_R, BLOCK_N,
                    HEAD_DIM, D_PAD, DOT_FP32)
    tl.store(lse_ptr + (h * GROUP + g) * stride_lh + r, lse, mask=rvalid)


@triton.jit(do_not_specialize=["R", "seq_len", "stride_lh", "stride_oh"],
            do_not_specialize_on_alignment=["vsum_ptr", "vmax_ptr", "ssum_ptr", "smax_ptr"])
def _lines_kernel(q_ptr, stride_qr, stride_qh, pos_ptr, R, k_ptr, stride_ks, stride_kh, slots_ptr, seq_len,
                  lse_ptr, stride_lh, vsum_ptr, vmax_ptr, ssum_ptr, smax_ptr, stride_oh, sm_scale_log2,
                  GROUP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                  HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, DOT_FP32: tl.constexpr):
    h = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    kp = n0 + tl.arange(0, BLOCK_N)
    kvalid = kp < seq_len
    slot = tl.load(slots_ptr + kp, mask=kvalid, other=0).to(tl.int64)
    v_acc = tl.zeros([BLOCK_N], tl.float32)
    v_mx = tl.zeros([BLOCK_N], tl.float32)
    for r0 in range(0, R, BLOCK_R):
        q, g, r, rvalid = _load_q(q_ptr, stride_qr, stride_qh, h, r0, R, GROUP, G_PAD, BLOCK_R, HEAD_DIM, D_PAD)
        pos = tl.load(pos_ptr + r, mask=rvalid, other=-1).to(tl.int64)
        lse = tl.load(lse_ptr + (h * GROUP + g) * stride_lh + r, mask=rvalid, other=float("inf"))
        pg = _group_probs(q, pos, rvalid, lse, k_ptr, stride_ks, stride_kh, h, slot, kp, kvalid, sm_scale_log2,
                          G_PAD, BLOCK_R, BLOCK_N, HEAD_DIM, D_PAD, DOT_FP32)  # group-summed entries
        v_acc += tl.sum(pg, axis=0)
        v_mx = tl.maximum(v_mx, tl.max(pg, axis=0))
        rr = r0 + tl.arange(0, BLOCK_R)
        prow = tl.load(pos_ptr + rr, mask=rr < R, other=-1).to(tl.int64)
        off = prow[:, None] - kp[None, :]
        smask = (rr < R)[:, None] & kvalid[None, :] & (off >= 0)
        tl.atomic_add(ssum_ptr + h * stride_oh + off, pg, mask=smask)
        tl.atomic_max(smax_ptr + h * stride_oh + off, pg, mask=smask)
    tl.store(vsum_ptr + h * stride_oh + kp, v_acc, mask=kvalid)
    tl.store(vmax_ptr + h * stride_oh + kp, v_mx, mask=kvalid)


def vs_estimate(q_rows: torch.Tensor, q_pos: torch.Tensor, k_buffer: torch.Tensor, token_slots: torch.Tensor,
                seq_len: int, *, sm_scale: float, block_r: int = 16, block_n: int = 64,
                target_programs: int | None = None, min_split_keys: int | None = None) -> VSLineSums:
    """Per-KV-head vertical and slash line sums of the sampled rows' causal softmax attention.

    Args:
      q_rows: ``[R, num_qo_heads, head_dim]`` post-RoPE queries of the sampled rows (bf16/fp16/fp32).
      q_pos: ``[R]`` int32/int64 distinct absolute positions, each ``< seq_len``.
      k_buffer: ``[num_slots, num_kv_heads, head_dim]`` one layer's keys (post-RoPE).
      token_slots: ``[>= seq_len]`` int32/int64 slot of each position (``req_to_token[req_pool_idx]``).
      seq_len: keys ``0..seq_len-1`` exist (host int: it sizes the outputs and the grid).
      sm_scale: softmax scale (usually ``head_dim ** -0.5``).
      target_programs, min_split_keys: host ints; at long contexts the LSE pass splits the keys into spans
        (:func:`flashinfer_ext.loopserve.vs_estimate_batched.lse_splits` with these; one more launch; defaults
        :func:`target_programs_of` the device and ``MIN_SPLIT_KEYS``).
    Returns :class:`VSLineSums` (``[num_kv_heads, seq_len]`` fp32 each; total mass per KV head is
    ``group_size * R``). Two launches (three with key spans), no host sync.
    """
    r, hq, d = q_rows.shape
    hk = k_buffer.shape[1]
    group = check_heads(hq, hk, d)
    if q_pos.shape != (r,):
        raise ValueError(f"q_pos has shape {tuple(q_pos.shape)}, expected ({r},)")
    dev = q_rows.device
    kw = dict(device=dev, dtype=torch.float32)
    out = VSLineSums(*torch.zeros(4, hk, seq_len, **kw).unbind(0), group, r)  # one fill for the four outputs
    if r == 0 or seq_len == 0:
        return out
    assert q_rows.stride(2) == 1 and k_buffer.stride(2) == 1
    lse = torch.empty(hq, r, **kw)
    meta = launch_meta(group, d, block_r, block_n)
    scale = float(sm_scale) / math.log(2.0)
    q_pos = q_pos.contiguous()
    row_blocks = triton.cdiv(r, meta["BLOCK_R"])
    num_splits = lse_splits(1, hk, row_blocks, seq_len, target_programs or target_programs_of(dev),
                            min_split_keys or MIN_SPLIT_KEYS)
    if num_splits > 1:  # long context: the keys in spans on separate programs (one more launch, the merge)
        split_len = triton.cdiv(triton.cdiv(seq_len, num_splits), block_n) * block_n
        indptr = torch.zeros(2, dtype=torch.int32, device=dev)
        indptr[1] = r
        split_lse(q_rows, q_pos, indptr, k_buffer, token_slots[None], torch.zeros(1, dtype=torch.int32, device=dev),
                  lse, scale, triton.cdiv(seq_len, split_len), split_len, row_blocks, meta)
    else:
        _row_lse_kernel[(hk, row_blocks)](
            q_rows, q_rows.stride(0), q_rows.stride(1), q_pos, r, k_buffer, k_buffer.stride(0), k_buffer.stride(1),
            token_slots, lse, lse.stride(0), scale, **meta)
    _lines_kernel[(hk, triton.cdiv(seq_len, block_n))](
        q_rows, q_rows.stride(0), q_rows.stride(1), q_pos, r, k_buffer, k_buffer.stride(0), k_buffer.stride(1),
        token_slots, seq_len, lse, lse.stride(0), out.v_sum, out.v_max, out.s_sum, out.s_max, out.v_sum.stride(0),
        scale, **meta)
    return out
