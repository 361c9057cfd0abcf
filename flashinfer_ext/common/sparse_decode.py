"""Sparse-page decode over per-(request, KV head) block lists, with an optional PSA stop test.

Supports: one decode query per request, GQA (the whole query-head group of a KV head
in one program), SGLang's KV layout ``[num_slots, num_kv_heads, head_dim]`` reached
through ``req_to_token``, block sizes 1..128 (page size, or logical blocks for page
size 1), bf16/fp16 KV. Each (request, KV head) reads its own list of logical blocks
in list order: first the ``n_forced`` forced blocks (sink + local), then ranked blocks
micro-batch by micro-batch. With ``epsilon < 1`` it runs PSA Alg. 1 on the GPU: after
every ranked micro-batch it estimates P_acc = AS_acc / (AS_acc + AS_min * N_left) per
query head and stops the pair once every head of the group has P_acc >= epsilon.
With ``epsilon == 1`` it attends the whole list: this is the plain sparse-page decode
primitive shared with LoopServe (pass its per-head lists and lengths).

One launch, grid ``[batch * num_kv_heads]``; the stop loop runs inside the program, so
there is no host sync, no per-layer host planning and the launch is CUDA-graph
capturable. Outputs: ``o`` and a BASE-2 ``lse`` (FlashInfer's ``return_lse``
convention, so partial results merge with ``flashinfer.merge_state``), and the number
of list entries read per pair.

Cautions:
  * Why Triton and not FlashInfer: FlashInfer's paged decode takes one page list per
    request shared by all KV heads; PSA needs a different list (and a different stop
    point) per KV head, and a stop test between micro-batches. The online-softmax merge
    across micro-batches is the in-kernel equivalent of ``merge_state`` (same base-2 math).
  * One program per (request, KV head): at ``batch * num_kv_heads`` well below the SM
    count the kernel is latency-bound. :class:`flashinfer_ext.psa.decode.PsaDecodeWrapper`
    no longer uses it: PSA runs split-K waves (:mod:`flashinfer_ext.psa.chunks` +
    :mod:`flashinfer_ext.psa.wave_merge`) with a chunk-granular stop test and a choice of
    estimator; this module stays the plain per-list primitive (and Alg. 1 with a fixed m).
  * AS_min only takes full, ranked blocks (forced and partial blocks are out of rank
    order); block masses below 2^-100 of the running maximum are floored.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from flashinfer_ext.common.tile_attention import attend_slots, group_query_state, list_tile_slots

__all__ = ["sparse_decode", "mask_to_lists", "decode_union_mask", "decode_union_lists", "decode_union_static",
           "decode_union_merge", "lists_to_mask"]

_BIG = torch.iinfo(torch.int32).max  # an invalid or duplicate list candidate (sorts last)


@triton.jit
def _attend_tile(q, k_ptr, v_ptr, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head, h,
                 rtt_row_ptr, lists_row_ptr, t0, t_end, nf, seq_len,
                 m_i, l_i, acc, lmin, sm_scale_log2,
                 G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr, SUB: tl.constexpr, DOT_FP32: tl.constexpr):
    """Attend list ranks ``[t0, min(t0 + SUB, t_end))``; update the online-softmax state and AS_min."""
    TOK: tl.constexpr = SUB * BLOCK_SIZE
    d = tl.arange(0, D_PAD)
    dmask = d < HEAD_DIM
    tok = tl.arange(0, TOK)
    slot, tvalid = list_tile_slots(lists_row_ptr, rtt_row_ptr, t0, t_end, seq_len, tok, BLOCK_SIZE)
    m_new, m_safe, l_i, acc, p = attend_slots(q, k_ptr, v_ptr, stride_k_slot, stride_k_head, stride_v_slot,
                                              stride_v_head, h, slot, tvalid, tvalid[None, :], d, dmask, m_i, l_i,
                                              acc, sm_scale_log2, DOT_FP32)
    # AS_min over full, ranked blocks of this tile (absolute base-2 log mass per query head)
    ranks = t0 + tl.arange(0, SUB)
    lb = tl.load(lists_row_ptr + ranks, mask=ranks < t_end, other=0).to(tl.int64)
    full = (ranks < t_end) & (ranks >= nf) & ((lb + 1) * BLOCK_SIZE <= seq_len)
    pb = tl.sum(tl.reshape(p, (G_PAD, SUB, BLOCK_SIZE)), axis=2)  # [G_PAD, SUB]
    lm = tl.log2(tl.maximum(pb, 1e-30)) + m_safe[:, None]
    lmin = tl.minimum(lmin, tl.min(tl.where(full[None, :], lm, float("inf")), axis=1))
    return m_new, l_i, acc, lmin


@triton.jit
def _sparse_decode_kernel(
    q_ptr, stride_qb, stride_qh,
    k_ptr, stride_k_slot, stride_k_head, v_ptr, stride_v_slot, stride_v_head,
    rtt_ptr, stride_rtt, rpi_ptr, seq_lens_ptr,
    lists_ptr, stride_lb, stride_lh, list_lens_ptr, stride_llb, n_forced_ptr,
    o_ptr, stride_ob, stride_oh, lse_ptr, stride_lseb, nread_ptr, stride_nb,
    sm_scale_log2, log2_eps, log2_1m_eps,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    SUB: tl.constexpr, MB: tl.constexpr, PROGRESSIVE: tl.constexpr, DOT_FP32: tl.constexpr,
):
    pid = tl.program_id(0)
    r = pid // NUM_KV_HEADS
    h = pid % NUM_KV_HEADS
    r64 = r.to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + r)
    n_blocks = (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE
    list_len = tl.load(list_lens_ptr + r64 * stride_llb + h)
    nf = tl.minimum(tl.load(n_forced_ptr + r), list_len)
    rpi = tl.load(rpi_ptr + r).to(tl.int64)
    rtt_row_ptr = rtt_ptr + rpi * stride_rtt
    lists_row_ptr = lists_ptr + r64 * stride_lb + h * stride_lh

    q, g, d, gmask, dmask, m_i, l_i, acc = group_query_state(q_ptr, stride_qb, stride_qh, r64, h, k_ptr,
                                                             GROUP, G_PAD, HEAD_DIM, D_PAD)
    lmin = tl.full([G_PAD], float("inf"), tl.float32)

    # forced blocks (sink + local): always read, no stop test
    for t0 in range(0, nf, SUB):
        m_i, l_i, acc, lmin = _attend_tile(
            q, k_ptr, v_ptr, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head, h,
            rtt_row_ptr, lists_row_ptr, t0, nf, nf, seq_len, m_i, l_i, acc, lmin, sm_scale_log2,
            G_PAD, HEAD_DIM, D_PAD, BLOCK_SIZE, SUB, DOT_FP32)

    # ranked blocks, micro-batch by micro-batch, stop test on the GPU after each one
    cur = nf
    done = (cur >= list_len).to(tl.int32)
    while done == 0:
        mb_end = tl.minimum(cur + MB, list_len)
        for t0 in range(cur, mb_end, SUB):
            m_i, l_i, acc, lmin = _attend_tile(
                q, k_ptr, v_ptr, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head, h,
                rtt_row_ptr, lists_row_ptr, t0, mb_end, nf, seq_len, m_i, l_i, acc, lmin, sm_scale_log2,
                G_PAD, HEAD_DIM, D_PAD, BLOCK_SIZE, SUB, DOT_FP32)
        cur = mb_end
        stop = (cur >= list_len).to(tl.int32)
        if PROGRESSIVE:
            n_left = n_blocks - cur
            lse_acc = m_i + tl.log2(tl.maximum(l_i, 1e-30))
            rhs = log2_eps + lmin + tl.log2(tl.maximum(n_left, 1).to(tl.float32))
            ok = ((lse_acc + log2_1m_eps) >= rhs) | (g >= GROUP)
            all_ok = tl.min(ok.to(tl.int32), axis=0)
            stop = stop | all_ok | (n_left <= 0).to(tl.int32)
        done = stop

    has = l_i > 0.0
    l_safe = tl.where(has, l_i, 1.0)
    o = acc / l_safe[:, None]
    lse = tl.where(has, m_i + tl.log2(l_safe), float("-inf"))
    qo = h * GROUP + g
    tl.store(o_ptr + r64 * stride_ob + qo[:, None] * stride_oh + d[None, :], o.to(o_ptr.dtype.element_ty),
             mask=gmask[:, None] & dmask[None, :])
    tl.store(lse_ptr + r64 * stride_lseb + qo, lse, mask=gmask)
    tl.store(nread_ptr + r64 * stride_nb + h, cur)


def decode_shapes(q: torch.Tensor, k_buffer: torch.Tensor, block_size: int) -> tuple[int, int, int, int]:
    """``(batch, num_qo_heads, head_dim, num_kv_heads)`` of a list decode call, checked (GQA group, block size)."""
    batch, num_qo_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"num_qo_heads={num_qo_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if not 1 <= block_size <= 128 or block_size & (block_size - 1):
        raise ValueError(f"block_size={block_size} must be a power of two in [1, 128]")
    return batch, num_qo_heads, head_dim, num_kv_heads


def decode_outputs(q: torch.Tensor, num_kv_heads: int, out=None, lse_out=None, nread_out=None):
    """The outputs of a list decode call, allocated where not given: ``out`` like ``q``, ``lse_out [batch,
    num_qo_heads]`` fp32, ``nread_out [batch, num_kv_heads]`` int32."""
    batch, num_qo_heads, _ = q.shape
    if out is None:
        out = torch.empty_like(q)
    if lse_out is None:
        lse_out = torch.empty(batch, num_qo_heads, dtype=torch.float32, device=q.device)
    if nread_out is None:
        nread_out = torch.empty(batch, num_kv_heads, dtype=torch.int32, device=q.device)
    return out, lse_out, nread_out


def sparse_decode(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                  req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                  block_lists: torch.Tensor, list_lens: torch.Tensor, n_forced: torch.Tensor, *,
                  block_size: int, sm_scale: float, epsilon: float = 1.0, micro_batch_blocks: int = 8,
                  out: torch.Tensor | None = None, lse_out: torch.Tensor | None = None,
                  nread_out: torch.Tensor | None = None, tile_tokens: int = 64):
    """Decode attention over per-(request, KV head) block lists; PSA stop test when ``epsilon < 1``.

    Args:
      q: ``[batch, num_qo_heads, head_dim]`` (post-RoPE), any float dtype (cast to the KV dtype).
      k_buffer, v_buffer: ``[num_slots, num_kv_heads, head_dim]`` bf16/fp16 (one layer).
      req_to_token: ``[max_reqs, max_context_len]`` int32; req_pool_indices: ``[batch]`` int.
      seq_lens: ``[batch]`` int32 (a block's tokens past ``seq_len`` are masked: partial last block).
      block_lists: ``[batch, num_kv_heads, L]`` int32/int64 logical block ids in attend order,
        forced blocks first; entries must be distinct and ``< ceil(seq_len / block_size)``.
      list_lens: ``[batch, num_kv_heads]`` int32 entries that may be read (<= L).
      n_forced: ``[batch]`` int32 leading entries read before any stop test.
      epsilon: kept-mass threshold; ``>= 1`` disables the stop test (attend the whole list).
      out: ``[batch, num_qo_heads, head_dim]`` output (default: q's dtype), lse_out ``[batch, num_qo_heads]``
        fp32 base 2, nread_out ``[batch, num_kv_heads]`` int32 entries read; allocated if None.

    Returns ``(out, lse_out, nread_out)``. One launch; allocation-free when the outputs are given.
    """
    batch, num_qo_heads, head_dim, num_kv_heads = decode_shapes(q, k_buffer, block_size)
    out, lse_out, nread_out = decode_outputs(q, num_kv_heads, out, lse_out, nread_out)
    if batch == 0:
        return out, lse_out, nread_out
    assert k_buffer.stride(2) == 1 and v_buffer.stride(2) == 1 and q.stride(2) == 1
    assert block_lists.stride(2) == 1 and list_lens.stride(1) == 1 and out.stride(2) == 1
    group = num_qo_heads // num_kv_heads
    sub = max(1, triton.next_power_of_2(max(tile_tokens, 16)) // block_size)
    progressive = epsilon < 1.0
    log2_eps = math.log2(epsilon) if progressive else 0.0
    log2_1m_eps = math.log2(1.0 - epsilon) if progressive else 0.0
    _sparse_decode_kernel[(batch * num_kv_heads,)](
        q, q.stride(0), q.stride(1),
        k_buffer, k_buffer.stride(0), k_buffer.stride(1), v_buffer, v_buffer.stride(0), v_buffer.stride(1),
        req_to_token, req_to_token.stride(0), req_pool_indices, seq_lens,
        block_lists, block_lists.stride(0), block_lists.stride(1), list_lens, list_lens.stride(0), n_forced,
        out, out.stride(0), out.stride(1), lse_out, lse_out.stride(0), nread_out, nread_out.stride(0),
        float(sm_scale) / math.log(2.0), log2_eps, log2_1m_eps,
        NUM_KV_HEADS=num_kv_heads, GROUP=group, G_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, D_PAD=max(16, triton.next_power_of_2(head_dim)), BLOCK_SIZE=block_size,
        SUB=sub, MB=micro_batch_blocks, PROGRESSIVE=progressive,
        DOT_FP32=os.environ.get("TRITON_INTERPRET", "0") == "1",
    )
    return out, lse_out, nread_out


def mask_to_lists(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token sets as :func:`sparse_decode` lists (``block_size=1``): bool ``[B, Hk, N]`` ->
    ``(lists [B, Hk, N] int32, lens [B, Hk] int32)``, each list ascending in its first ``lens``
    entries (the rest 0). Prefix-sum compaction (one cumsum + one scatter, O(N), no sort, no host sync).
    """
    b, hk, n = mask.shape
    m = mask.to(torch.int32)
    rank = m.cumsum(2, dtype=torch.int32) - 1                          # target index of each set token
    dest = torch.where(mask, rank, n).long()                           # unset tokens -> spill column n
    ar = torch.arange(n, device=mask.device, dtype=torch.int32).expand(b, hk, n)
    lists = torch.zeros(b, hk, n + 1, dtype=torch.int32, device=mask.device).scatter_(2, dest, ar)
    return lists[:, :, :n].contiguous(), m.sum(2, dtype=torch.int32).contiguous()


def decode_union_mask(v_idx: torch.Tensor, s_idx: torch.Tensor, topb: torch.Tensor, pos: torch.Tensor,
                      since: torch.Tensor, seq_lens: torch.Tensor, *, sink_tokens: int, max_len: int) -> torch.Tensor:
    """LoopServe Alg. 3's decode set per (row, KV head) as a bool mask ``[B, Hk, max_len]``.

    Union of: stored vertical lines ``v_idx [B, Hk, Wv]`` (key positions), slash offsets
    ``s_idx [B, Hk, Ws]`` taken relative to the current position ``pos [B]`` (key ``pos - s``),
    the top-B positions ``topb [B, Hk, Wb]``, the first ``sink_tokens`` keys, and every key at
    ``>= since [B]``; all clipped to ``< seq_lens [B]``. ``-1`` entries are padding. Device tensors,
    a few scatters, no host sync (``max_len`` is a host int: the batch's longest context).
    """
    b, hk = v_idx.shape[0], v_idx.shape[1]
    n = max_len
    m = torch.zeros(b, hk, n + 1, dtype=torch.bool, device=v_idx.device)
    v = v_idx.long()
    m.scatter_(2, torch.where(v >= 0, v, n).clamp(max=n), True)
    s = s_idx.long()
    sp = pos.long()[:, None, None] - s
    m.scatter_(2, torch.where((s >= 0) & (sp >= 0), sp, n).clamp(max=n), True)
    tb = topb.long()
    m.scatter_(2, torch.where(tb >= 0, tb, n).clamp(max=n), True)
    ar = torch.arange(n + 1, device=v_idx.device)[None, None, :]
    m |= ar < sink_tokens
    m |= ar >= since.long()[:, None, None]
    return (m & (ar < seq_lens.long()[:, None, None]))[:, :, :n]


def decode_union_static(v_idx: torch.Tensor, s_idx: torch.Tensor, pos: torch.Tensor, since: torch.Tensor,
                        seq_lens: torch.Tensor, *, sink_tokens: int, max_since: int) -> torch.Tensor:
    """The part of :func:`decode_union_lists`' sets that does not depend on top-B, as unsorted candidates.

    Inputs as :func:`decode_union_lists` (no ``topb``). Returns ``[B, Hk, Wv + Ws + sink_tokens + max_since]``
    int32: the line positions, the slash offsets taken at ``pos``, the sink and the tail from ``since``, every
    entry outside ``[0, seq_lens)`` set to ``INT32_MAX`` (duplicates kept). Built once per decode step for all
    layers (a layer-major batch ``B = L * rows``); :func:`decode_union_merge` adds a layer's top-B."""
    b, hk = v_idx.shape[0], v_idx.shape[1]
    dev = v_idx.device
    i32 = torch.int32  # positions < 2^31: int32 halves the temporaries of the all-layer call
    seq = seq_lens.to(i32)[:, None, None]
    s = s_idx.to(i32)
    sp = torch.where(s >= 0, pos.to(i32)[:, None, None] - s, -1)
    sink = torch.arange(sink_tokens, device=dev, dtype=i32).expand(b, hk, sink_tokens)
    tail = since.to(i32)[:, None, None] + torch.arange(max_since, device=dev, dtype=i32)[None, None, :]
    cand = torch.cat([v_idx.to(i32), sp, sink, tail.expand(b, hk, max_since)], dim=2)
    return torch.where((cand >= 0) & (cand < seq), cand, _BIG)


def decode_union_merge(static: torch.Tensor, topb: torch.Tensor,
                       seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`decode_union_static`'s candidates ``[B, Hk, Ws]`` ∪ the top-B positions ``topb [B, Hk, Wb]``
    (``-1`` padded, clipped to ``< seq_lens [B]``) as lists: ``(lists [B, Hk, Ws + Wb] int32, lens [B, Hk]
    int32)``, each list ascending and duplicate-free in its first ``lens`` entries, the rest 0. Two sorts (the
    second moves the duplicates, marked ``INT32_MAX``, behind the kept entries); no host sync."""
    tb = topb.to(torch.int32)
    tb = torch.where((tb >= 0) & (tb < seq_lens.to(torch.int32)[:, None, None]), tb, _BIG)
    srt = torch.cat([static, tb], dim=2).sort(dim=2).values
    prev = torch.nn.functional.pad(srt[:, :, :-1], (1, 0), value=-1)
    srt = torch.where(srt == prev, _BIG, srt).sort(dim=2).values
    kept = srt != _BIG
    return torch.where(kept, srt, 0).contiguous(), kept.sum(2, dtype=torch.int32)


def decode_union_lists(v_idx: torch.Tensor, s_idx: torch.Tensor, topb: torch.Tensor, pos: torch.Tensor,
                       since: torch.Tensor, seq_lens: torch.Tensor, *, sink_tokens: int,
                       max_since: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The sets of :func:`decode_union_mask` as :func:`sparse_decode` lists, without a context-wide mask.

    Same inputs (``v_idx [B, Hk, Wv]``, ``s_idx [B, Hk, Ws]``, ``topb [B, Hk, Wb]``, ``-1`` padded; ``pos``,
    ``since``, ``seq_lens`` ``[B]``), but ``max_since`` (a host int, ``>= max(seq_lens - since)``: the longest
    always-attended tail) instead of the context length. Returns ``(lists [B, Hk, W] int32, lens [B, Hk]
    int32)``, ``W = Wv + Ws + Wb + sink_tokens + max_since``: each list ascending and duplicate-free in its
    first ``lens`` entries (the rest 0), equal to ``mask_to_lists(decode_union_mask(...))`` there.

    Work and memory are O(W) per (row, KV head), independent of the context (the mask path allocates
    ``[B, Hk, N]`` several times: at 128k tokens x 32 rows x 8 KV heads that is ~1 GB of temporaries).
    :func:`decode_union_static` + :func:`decode_union_merge`: one concat + two sorts; no host sync.
    """
    static = decode_union_static(v_idx, s_idx, pos, since, seq_lens, sink_tokens=sink_tokens, max_since=max_since)
    return decode_union_merge(static, topb, seq_lens)


def lists_to_mask(lists: torch.Tensor, lens: torch.Tensor, max_len: int) -> torch.Tensor:
    """Inverse of :func:`mask_to_lists`: ``lists [B, Hk, W]`` (first ``lens [B, Hk]`` valid) -> bool
    ``[B, Hk, max_len]`` (for the fp32 masked-decode reference path)."""
    b, hk, w = lists.shape
    valid = torch.arange(w, device=lists.device)[None, None, :] < lens.long()[:, :, None]
    m = torch.zeros(b, hk, max_len + 1, dtype=torch.bool, device=lists.device)
    m.scatter_(2, torch.where(valid, lists.long(), max_len), True)
    return m[:, :, :max_len]
