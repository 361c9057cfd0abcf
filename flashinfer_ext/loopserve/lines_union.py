"""LoopServe's decode lists at a step without re-selection, for every layer at once, without a sort (Triton).

A decode row attends, per layer and KV head, the union of its *base* (the stored vertical lines, the current
top-B and the sink: fixed between two selections, kept sorted and deduplicated), its slash lines taken at the
current position ``pos = seq_len - 1`` (key ``pos - s`` for each selected offset ``s``) and its tail (every position from ``since``,
the last selection, up to the current one). Only the last two move from one step to the next. :func:`lines_union`
builds the lists from the base and the offsets in one launch: it copies the base, then appends every slash key
``< since`` and every tail key that the base does not hold (one binary search each, as
:func:`flashinfer_ext.loopserve.list_union.union_append` does for top-B). A slash key ``>= since`` lies in the tail,
so the two appended parts are disjoint and no list holds a position twice. The set is exactly
:func:`flashinfer_ext.common.sparse_decode.decode_union_lists`' (lines, slash keys, sink, tail, top-B, all below the
row's length); the order differs (the base ascending, then the slash keys in offset order, then the tail), which
the decode kernels do not care about.

Supports: ``base [R, L, Hk, Wa]`` int32 (ascending and duplicate-free in the first ``base_lens [R, L, Hk]``
entries, every entry below its row's length), ``s_idx [R, L, Hk, Ws]`` int32 offsets (distinct per (row, layer,
head), ``-1`` padded), ``since`` / ``seq_lens`` ``[R]`` int32 or int64 (contiguous). Output ``lists [L, R, Hk, W]`` int32
(layer-major, ``W >= Wa + Ws + max_since``) and ``lens [L, R, Hk]``, zeros after ``lens``. Grid ``[L * R * Hk]``;
widths and the search depth are runtime ints; no host sync.

Cautions: the base must really be sorted and the offsets distinct (not checked); ``max_since`` (a host int) must
be ``>= max(seq_lens - since)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashinfer_ext.loopserve.list_union import in_sorted

__all__ = ["lines_union", "lines_union_reference", "lines_base"]


@triton.jit
def _lines_union_kernel(b_ptr, b_sr, b_sl, b_sh, blens_ptr, bl_sr, bl_sl, s_ptr, s_sr, s_sl, s_sh,
                        since_ptr, seq_ptr, o_ptr, o_sl, o_sr, o_sh, lens_ptr, ln_sl, ln_sr,
                        e_ptr, e_sr, e_sl, e_sh, sl_ptr, sl_sr, sl_sl,
                        rows, num_kv_heads, wa, ws, we, wout, depth, s_depth, BLOCK: tl.constexpr,
                        HAS_EXTRA: tl.constexpr, ZERO_FILL: tl.constexpr):
    pid = tl.program_id(0)
    h = pid % num_kv_heads
    rl = pid // num_kv_heads
    r = rl % rows
    layer = rl // rows
    r64 = r.to(tl.int64)
    l64 = layer.to(tl.int64)
    base = b_ptr + r64 * b_sr + l64 * b_sl + h * b_sh
    ls = tl.load(blens_ptr + r64 * bl_sr + l64 * bl_sl + h)
    offs_row = s_ptr + r64 * s_sr + l64 * s_sl + h * s_sh
    out = o_ptr + l64 * o_sl + r64 * o_sr + h * o_sh
    since = tl.load(since_ptr + r).to(tl.int32)
    seq = tl.load(seq_ptr + r).to(tl.int32)
    pos = seq - 1  # the decode step's own position
    # phase 1: the base (ZERO_FILL: zeros after it, up to wout)
    if ZERO_FILL:
        for c0 in range(0, wout, BLOCK):
            i = c0 + tl.arange(0, BLOCK)
            tl.store(out + i, tl.load(base + i, mask=i < ls, other=0), mask=i < wout)
    else:
        for c0 in range(0, ls, BLOCK):
            i = c0 + tl.arange(0, BLOCK)
            tl.store(out + i, tl.load(base + i, mask=i < ls, other=0), mask=i < ls)
    tl.debug_barrier()
    n = ls
    n_s = ws
    if HAS_EXTRA:
        n_s = tl.load(sl_ptr + r64 * sl_sr + l64 * sl_sl + h)
        # phase 1b: the extra positions (a new top-B) below since that are neither in the base nor slash keys
        # (pos - t among the ascending offsets); those from since on are the tail's
        e_row = e_ptr + r64 * e_sr + l64 * e_sl + h * e_sh
        for c0 in range(0, we, BLOCK):
            i = c0 + tl.arange(0, BLOCK)
            t = tl.load(e_row + i, mask=i < we, other=-1)
            valid = (t >= 0) & (t < since) & (t < seq)
            keep = valid & ~in_sorted(base, t, ls, depth, BLOCK) & ~in_sorted(offs_row, pos - t, n_s, s_depth, BLOCK)
            k = keep.to(tl.int32)
            tl.store(out + n + tl.cumsum(k, 0) - k, t, mask=keep)
            n += tl.sum(k, 0)
    # phase 2: slash keys pos - s below since (keys from since on are the tail's) that the base lacks
    for c0 in range(0, n_s, BLOCK):
        i = c0 + tl.arange(0, BLOCK)
        s = tl.load(offs_row + i, mask=i < n_s, other=-1)
        t = pos - s
        valid = (s >= 0) & (t >= 0) & (t < since) & (t < seq)
        keep = valid & ~in_sorted(base, t, ls, depth, BLOCK)
        k = keep.to(tl.int32)
        tl.store(out + n + tl.cumsum(k, 0) - k, t, mask=keep)
        n += tl.sum(k, 0)
    # phase 3: the tail since .. seq - 1 that the base lacks (a top-B chosen at `since` may hold it)
    for c0 in range(0, seq - since, BLOCK):
        t = since + c0 + tl.arange(0, BLOCK)
        keep = (t < seq) & ~in_sorted(base, t, ls, depth, BLOCK)
        k = keep.to(tl.int32)
        tl.store(out + n + tl.cumsum(k, 0) - k, t, mask=keep)
        n += tl.sum(k, 0)
    tl.store(lens_ptr + l64 * ln_sl + r64 * ln_sr + h, n)


def _check(base, base_lens, s_idx, since, seq_lens):
    r, n_l, hk, _ = base.shape
    if base_lens.shape != (r, n_l, hk) or s_idx.shape[:3] != (r, n_l, hk) or any(
            t.shape != (r,) for t in (since, seq_lens)):
        raise ValueError(f"shapes do not match: base {tuple(base.shape)}, base_lens {tuple(base_lens.shape)}, s_idx "
                         f"{tuple(s_idx.shape)}, since / seq_lens {tuple(since.shape)} / {tuple(seq_lens.shape)}")
    for name, t in (("base", base), ("base_lens", base_lens), ("s_idx", s_idx)):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")


def lines_union(base: torch.Tensor, base_lens: torch.Tensor, s_idx: torch.Tensor, since: torch.Tensor,
                seq_lens: torch.Tensor, *, max_since: int, out: torch.Tensor | None = None,
                lens_out: torch.Tensor | None = None, block: int = 256, extra: torch.Tensor | None = None,
                s_lens: torch.Tensor | None = None, zero_fill: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Every layer's decode lists of a step without re-selection (module docstring): ``(lists [L, R, Hk, W] int32,
    lens [L, R, Hk] int32)``, ``W = Wa + Ws + max_since``. ``out`` / ``lens_out``: preallocated outputs (``out``
    ``[L, R, Hk, >= W]`` with a contiguous last dim; the first ``W`` columns are written). One launch.

    A re-selection step adds its new top-B: ``extra [R, L, Hk, We]`` int32 (``-1`` padded, distinct per list) with
    ``s_lens [R, L, Hk]`` int32, the number of offsets in each ``s_idx`` row (which must then be ascending in
    those first entries): each extra position below ``since`` that is neither in the base nor a slash key goes
    after the base (those from ``since`` on are the tail's), so the list is the union with no position twice;
    ``W`` grows by ``We``. The offset loop then runs to ``s_lens``, not to ``Ws``.

    ``zero_fill`` False: nothing is written after each list's ``lens`` entries (the consumers read ``lens``), and
    with ``out`` given its width is the caller's bound on every list's length (a CUDA graph's static width,
    at least the longest context), not ``W``."""
    _check(base, base_lens, s_idx, since, seq_lens)
    r, n_l, hk, wa = base.shape
    ws = s_idx.shape[3]
    we = 0 if extra is None else extra.shape[3]
    w = wa + ws + we + max(int(max_since), 0)
    dev = base.device
    if extra is not None and (tuple(extra.shape[:3]) != (r, n_l, hk) or extra.dtype != torch.int32
                              or s_lens is None or tuple(s_lens.shape) != (r, n_l, hk)
                              or s_lens.dtype != torch.int32 or extra.stride(3) != 1 or s_lens.stride(2) != 1):
        raise ValueError(f"extra must be [{r}, {n_l}, {hk}, We] int32 (last dim contiguous) with s_lens "
                         f"[{r}, {n_l}, {hk}] int32")
    if out is None:
        out = torch.empty(n_l, r, hk, w, dtype=torch.int32, device=dev)
    elif out.dtype != torch.int32 or tuple(out.shape[:3]) != (n_l, r, hk) or out.stride(3) != 1 or (
            zero_fill and out.shape[3] < w):
        raise ValueError(f"out must be [{n_l}, {r}, {hk}, >= {w}] int32 with a contiguous last dim")
    if zero_fill or out.shape[3] > w:
        out = out[..., :w]
    if lens_out is None:
        lens_out = torch.empty(n_l, r, hk, dtype=torch.int32, device=dev)
    elif lens_out.dtype != torch.int32 or tuple(lens_out.shape) != (n_l, r, hk) or lens_out.stride(2) != 1:
        raise ValueError(f"lens_out must be [{n_l}, {r}, {hk}] int32 with a contiguous last dim")
    if r * n_l * hk == 0:
        return out, lens_out
    assert base.stride(3) == 1 and s_idx.stride(3) == 1 and base_lens.stride(2) == 1
    assert since.is_contiguous() and seq_lens.is_contiguous()
    e, sl = (extra, s_lens) if extra is not None else (base, base_lens)  # placeholders when HAS_EXTRA is off
    _lines_union_kernel[(n_l * r * hk,)](
        base, base.stride(0), base.stride(1), base.stride(2), base_lens, base_lens.stride(0), base_lens.stride(1),
        s_idx, s_idx.stride(0), s_idx.stride(1), s_idx.stride(2),
        since, seq_lens,
        out, out.stride(0), out.stride(1), out.stride(2), lens_out, lens_out.stride(0), lens_out.stride(1),
        e, e.stride(0), e.stride(1), e.stride(2), sl, sl.stride(0), sl.stride(1),
        r, hk, wa, ws, we, out.shape[3], max(wa, 1).bit_length(), max(ws, 1).bit_length(), BLOCK=block,
        HAS_EXTRA=extra is not None, ZERO_FILL=zero_fill)
    return out, lens_out


def lines_union_reference(base: torch.Tensor, base_lens: torch.Tensor, s_idx: torch.Tensor, since: torch.Tensor,
                          seq_lens: torch.Tensor, *, max_since: int,
                          extra: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch reference of :func:`lines_union` (same layout and order; zeros after ``lens``), a loop over
    (row, layer, head)."""
    _check(base, base_lens, s_idx, since, seq_lens)
    r, n_l, hk, wa = base.shape
    we = 0 if extra is None else extra.shape[3]
    w = wa + s_idx.shape[3] + we + max(int(max_since), 0)
    out = torch.zeros(n_l, r, hk, w, dtype=torch.int32)
    lens = torch.zeros(n_l, r, hk, dtype=torch.int32)
    for j in range(r):
        lo, n = int(since[j]), int(seq_lens[j])
        p = n - 1
        for layer in range(n_l):
            for h in range(hk):
                b = base[j, layer, h, : int(base_lens[j, layer, h])].cpu()
                have = set(b.tolist())
                offs = [s for s in s_idx[j, layer, h].tolist() if s >= 0]
                slash = [p - s for s in offs if 0 <= p - s < min(lo, n)]
                tail = list(range(lo, n))
                top = [] if extra is None else [t for t in extra[j, layer, h].tolist()
                                                if 0 <= t < min(lo, n) and p - t not in offs]
                new = [t for t in top + slash + tail if t not in have]
                got = b.tolist() + new
                out[layer, j, h, : len(got)] = torch.tensor(got, dtype=torch.int32)
                lens[layer, j, h] = len(got)
    return out.to(base.device), lens.to(base.device)


def lines_base(v_idx: torch.Tensor, topb: torch.Tensor | None, sink_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's base lists: its vertical lines ``v_idx [L, Hk, Wv]`` ∪ its top-B ``topb [L, Hk, Wb]`` (None:
    none yet) ∪ the sink ``0 .. sink_tokens - 1``, each ``-1`` padded, as ``(base [L, Hk, Wa] int32 ascending and
    duplicate-free in the first lens entries (zeros after), lens [L, Hk] int32)``. Once per request and
    selection (two sorts of ``Wv + Wb + sink_tokens`` entries per layer and head)."""
    from flashinfer_ext.common.sparse_decode import _BIG, decode_union_merge

    n_l, hk, _ = v_idx.shape
    dev = v_idx.device
    sink = torch.arange(sink_tokens, dtype=torch.int32, device=dev).expand(n_l, hk, sink_tokens)
    parts = [v_idx.to(torch.int32), sink] + ([topb.to(torch.int32)] if topb is not None else [])
    cand = torch.cat(parts, dim=2)
    static = torch.where(cand >= 0, cand, _BIG)
    no_more = static.new_empty(n_l, hk, 0)
    return decode_union_merge(static, no_more, torch.full((n_l,), _BIG, dtype=torch.int32, device=dev))
