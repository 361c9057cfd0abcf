"""Union of sorted token lists with a small unsorted list, per (row, KV head), in one launch (Triton).

LoopServe's decode set at a re-selection step is (stored lines ∪ slash offsets ∪ sink ∪ tail) ∪ the layer's new
top-B. The first part is the same for every layer's step shape and is sorted and deduplicated once per step
(:func:`flashinfer_ext.common.sparse_decode.decode_union_merge` with no top-B); :func:`union_append` then adds one
layer's top-B to it: each top-B entry is looked up in the sorted list by binary search and appended when absent,
in its original order. One launch per layer instead of a concat and two sorts (each sort is several launches).

Supports: ``sorted_lists [B, Hk, Ws]`` int32, ascending and duplicate-free in the first ``sorted_lens [B, Hk]``
entries; ``extra [B, Hk, We]`` int32 distinct within each (row, head), ``-1`` padded; entries ``>= seq_lens[b]``
are dropped. Output ``lists [B, Hk, Ws + We]`` int32: the sorted part first, then the new entries (so the list
is NOT ascending as a whole: :func:`flashinfer_ext.common.split_decode.sparse_decode_split` and
:func:`flashinfer_ext.common.sparse_decode.sparse_decode` attend a list in any order), zeros after ``lens``. Grid
``[B * Hk]``; no host sync; the widths and the binary-search depth are runtime ints (no recompilation as they
change from step to step).

Cautions: duplicates inside ``extra`` are not removed (top-B lists have none); ``sorted_lists`` must really be
sorted (not checked).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["union_append", "union_append_reference"]


@triton.jit
def in_sorted(base, t, ls, depth, BLOCK: tl.constexpr):
    """Whether each ``t [BLOCK]`` is among the first ``ls`` entries of the ascending row at ``base`` (binary search,
    ``depth >= bit_length(ls)`` steps)."""
    lo = tl.zeros([BLOCK], tl.int32)
    hi = tl.zeros([BLOCK], tl.int32) + ls
    for _ in range(depth):  # lo = first index with base[lo] >= t
        active = lo < hi
        mid = (lo + hi) >> 1
        v = tl.load(base + mid, mask=active, other=0)
        right = v < t
        lo = tl.where(active & right, mid + 1, lo)
        hi = tl.where(active & (~right), mid, hi)
    return tl.load(base + lo, mask=lo < ls, other=-1) == t


@triton.jit(do_not_specialize=["s_stride_b", "s_stride_h", "e_stride_b", "e_stride_h", "o_stride_b", "o_stride_h",
                               "ws", "we", "depth"])
def _union_append_kernel(s_ptr, s_stride_b, s_stride_h, slens_ptr, e_ptr, e_stride_b, e_stride_h, seq_ptr,
                         o_ptr, o_stride_b, o_stride_h, lens_ptr, num_kv_heads, ws, we, depth,
                         BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    b = pid // num_kv_heads
    h = pid % num_kv_heads
    ls = tl.load(slens_ptr + pid)
    seq = tl.load(seq_ptr + b)
    s_base = s_ptr + b.to(tl.int64) * s_stride_b + h * s_stride_h
    e_base = e_ptr + b.to(tl.int64) * e_stride_b + h * e_stride_h
    o_base = o_ptr + b.to(tl.int64) * o_stride_b + h * o_stride_h
    # phase 1: the sorted part (zeros after ls) and zeros over the appended region
    for s0 in range(0, ws + we, BLOCK):
        offs = s0 + tl.arange(0, BLOCK)
        v = tl.load(s_base + offs, mask=offs < ls, other=0)
        tl.store(o_base + offs, v, mask=offs < ws + we)
    tl.debug_barrier()
    # phase 2: every extra entry that is valid and not in the sorted part, appended in order
    n = ls
    for e0 in range(0, we, BLOCK):
        offs = e0 + tl.arange(0, BLOCK)
        t = tl.load(e_base + offs, mask=offs < we, other=-1)
        valid = (t >= 0) & (t < seq)
        keep = valid & ~in_sorted(s_base, t, ls, depth, BLOCK)
        k = keep.to(tl.int32)
        dest = n + tl.cumsum(k, 0) - k
        tl.store(o_base + dest, t, mask=keep)
        n += tl.sum(k, 0)
    tl.store(lens_ptr + pid, n)


def union_append(sorted_lists: torch.Tensor, sorted_lens: torch.Tensor, extra: torch.Tensor, seq_lens: torch.Tensor,
                 *, out: torch.Tensor | None = None, lens_out: torch.Tensor | None = None,
                 block: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """``sorted_lists [B, Hk, Ws]`` (first ``sorted_lens [B, Hk]`` entries) ∪ ``extra [B, Hk, We]`` (``-1``
    padded, entries ``< seq_lens [B]``) -> ``(lists [B, Hk, Ws + We] int32, lens [B, Hk] int32)`` (module
    docstring). ``out`` / ``lens_out`` optional preallocated outputs (``out``'s last dim contiguous, at least
    ``Ws + We`` wide). One launch."""
    b, hk, ws = sorted_lists.shape
    we = extra.shape[2]
    if extra.shape[:2] != (b, hk) or sorted_lens.shape != (b, hk) or seq_lens.shape != (b,):
        raise ValueError(f"shapes do not match: sorted_lists {tuple(sorted_lists.shape)}, sorted_lens "
                         f"{tuple(sorted_lens.shape)}, extra {tuple(extra.shape)}, seq_lens {tuple(seq_lens.shape)}")
    for name, t in (("sorted_lists", sorted_lists), ("sorted_lens", sorted_lens), ("extra", extra)):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
    if out is None:
        out = torch.empty(b, hk, ws + we, dtype=torch.int32, device=sorted_lists.device)
    elif out.dtype != torch.int32 or out.shape[:2] != (b, hk) or out.shape[2] < ws + we or out.stride(2) != 1:
        raise ValueError(f"out must be [{b}, {hk}, >= {ws + we}] int32 with a contiguous last dim")
    out = out[:, :, : ws + we]
    if lens_out is None:
        lens_out = torch.empty(b, hk, dtype=torch.int32, device=sorted_lists.device)
    if b * hk == 0:
        return out, lens_out
    assert sorted_lists.stride(2) == 1 and extra.stride(2) == 1
    lens_in = sorted_lens.contiguous()
    seq = seq_lens.to(torch.int32).contiguous()
    _union_append_kernel[(b * hk,)](
        sorted_lists, sorted_lists.stride(0), sorted_lists.stride(1), lens_in, extra, extra.stride(0),
        extra.stride(1), seq, out, out.stride(0), out.stride(1), lens_out, hk, ws, we, max(ws, 1).bit_length(),
        BLOCK=block)
    return out, lens_out


def union_append_reference(sorted_lists: torch.Tensor, sorted_lens: torch.Tensor, extra: torch.Tensor,
                           seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch reference of :func:`union_append` (same layout: the sorted part, then the new entries in
    their order, zeros after ``lens``); a broadcast compare, ``O(Ws * We)`` memory per (row, head)."""
    b, hk, ws = sorted_lists.shape
    we = extra.shape[2]
    s_valid = torch.arange(ws, device=sorted_lists.device)[None, None, :] < sorted_lens[:, :, None]
    present = ((extra[:, :, :, None] == sorted_lists[:, :, None, :]) & s_valid[:, :, None, :]).any(3)
    keep = (extra >= 0) & (extra < seq_lens.to(extra.device)[:, None, None]) & ~present
    out = torch.zeros(b, hk, ws + we, dtype=torch.int32, device=sorted_lists.device)
    lens = torch.zeros(b, hk, dtype=torch.int32, device=sorted_lists.device)
    for i in range(b):
        for h in range(hk):
            ls = int(sorted_lens[i, h])
            new = extra[i, h][keep[i, h]]
            out[i, h, :ls] = sorted_lists[i, h, :ls]
            out[i, h, ls: ls + new.numel()] = new
            lens[i, h] = ls + new.numel()
    return out, lens
