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
head), ``-1`` padded: a list's offsets first, ``-1`` after them; each program walks only its own), ``since`` /
``seq_lens`` ``[R]`` int32 or int64 (contiguous). Output ``lists [L, R, Hk, W]`` int32 (layer-major,
``W >= Wa + Ws + max_since``) and ``lens [L, R, Hk]``, zeros after ``lens``. Grid ``[L * R * Hk]``; widths and the
search depths are runtime ints; no host sync.

A re-selection step's new top-B is added per layer by :func:`lines_append`: a kept top-B position lies below
``since`` and is neither in the base (ascending: binary search) nor a slash key (ascending offsets make the kept
slash keys strictly descending: binary search too), so the lists stay duplicate-free without a sort.

Cautions: the base must really be sorted and the offsets distinct (not checked; for :func:`lines_append` also
ascending); ``max_since`` (a host int) must be ``>= max(seq_lens - since)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashinfer_ext.loopserve.list_union import in_sorted

__all__ = ["lines_union", "lines_union_reference", "lines_append", "lines_append_reference", "lines_base", "BLOCK",
           "union_block"]

# entries per program iteration. Both kernels run one program per list and walk it serially (copy, then binary
# searches of dependent loads), so with few programs their time is the number of iterations times their latency,
# not bandwidth. On an H200 (bench/results/lines_union_blocks.md, CUDA-graph replays, 30 layers x 3 KV heads, ~10k
# entries per list): lines_append (one program per row and KV head) took 21 us per layer at 256 entries and 10 us at
# 1024 at every batch size; lines_union (one program per layer, row and KV head) was fastest at 1024 entries with
# 90 programs (one row), at 512 with 720 (8 rows) and at 256 with 2880 (32 rows), where the launch is
# bandwidth-bound. The lists written are the same for every block (the order is fixed by the entries).
BLOCK = 1024


def union_block(programs: int) -> int:
    """:func:`lines_union`'s entries per iteration for a launch of ``programs`` lists (see :data:`BLOCK`)."""
    return 1024 if programs <= 256 else 512 if programs <= 1024 else 256


def _warps(block: int) -> int:
    """Warps of a launch with ``block`` entries per iteration: Triton's default 4 up to 512 entries, 8 above."""
    return 8 if block > 512 else 4


@triton.jit(do_not_specialize=["b_sr", "b_sl", "b_sh", "bl_sr", "bl_sl", "s_sr", "s_sl", "s_sh", "o_sl", "o_sr", "o_sh",
                               "ln_sl", "ln_sr", "mk_sl", "mk_sr", "rows", "wa", "ws", "wout", "depth", "sdepth"])
def _lines_union_kernel(b_ptr, b_sr, b_sl, b_sh, blens_ptr, bl_sr, bl_sl, s_ptr, s_sr, s_sl, s_sh,
                        since_ptr, seq_ptr, o_ptr, o_sl, o_sr, o_sh, lens_ptr, ln_sl, ln_sr, mk_ptr, mk_sl, mk_sr,
                        rows, num_kv_heads, wa, ws, wout, depth, sdepth, BLOCK: tl.constexpr, HAS_MARKS: tl.constexpr,
                        ZERO_FILL: tl.constexpr):
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
    # phase 2: slash keys pos - s below since (keys from since on are the tail's) that the base lacks. The offsets
    # are this list's first, -1 after: its own count (a binary search on s >= 0) bounds the walk, not the padded
    # width Ws, the batch's widest list (a diffuse head can select thousands of offsets where most select ~1k)
    lo = ws * 0
    hi = ws + 0
    for _ in range(sdepth):
        act = lo < hi
        mid = (lo + hi) // 2
        got = tl.load(offs_row + mid, mask=act, other=-1) >= 0
        lo = tl.where(act & got, mid + 1, lo)
        hi = tl.where(act & (~got), mid, hi)
    for c0 in range(0, lo, BLOCK):
        i = c0 + tl.arange(0, BLOCK)
        s = tl.load(offs_row + i, mask=i < lo, other=-1)
        t = pos - s
        valid = (s >= 0) & (t >= 0) & (t < since) & (t < seq)
        keep = valid & ~in_sorted(base, t, ls, depth, BLOCK)
        k = keep.to(tl.int32)
        tl.store(out + n + tl.cumsum(k, 0) - k, t, mask=keep)
        n += tl.sum(k, 0)
    if HAS_MARKS:  # where the base ends and where the slash keys end (lines_append searches both parts)
        mk = mk_ptr + l64 * mk_sl + r64 * mk_sr + h * 2
        tl.store(mk, ls)
        tl.store(mk + 1, n)
    # phase 3: the tail since .. seq - 1 that the base lacks (a top-B chosen at `since` may hold it)
    for c0 in range(0, seq - since, BLOCK):
        t = since + c0 + tl.arange(0, BLOCK)
        keep = (t < seq) & ~in_sorted(base, t, ls, depth, BLOCK)
        k = keep.to(tl.int32)
        tl.store(out + n + tl.cumsum(k, 0) - k, t, mask=keep)
        n += tl.sum(k, 0)
    tl.store(lens_ptr + l64 * ln_sl + r64 * ln_sr + h, n)


@triton.jit
def _in_descending(row, t, n, depth, BLOCK: tl.constexpr):
    """Whether each ``t [BLOCK]`` is among the first ``n`` entries of the strictly descending row at ``row``."""
    lo = tl.zeros([BLOCK], tl.int32)
    hi = tl.zeros([BLOCK], tl.int32) + n
    for _ in range(depth):  # lo = first index with row[lo] <= t
        active = lo < hi
        mid = (lo + hi) >> 1
        v = tl.load(row + mid, mask=active, other=0)
        right = v > t
        lo = tl.where(active & right, mid + 1, lo)
        hi = tl.where(active & (~right), mid, hi)
    return tl.load(row + lo, mask=lo < n, other=-1) == t


@triton.jit(do_not_specialize=["l_sr", "l_sh", "ln_sr", "mk_sr", "e_sr", "e_sh", "we", "depth"])
def _lines_append_kernel(l_ptr, l_sr, l_sh, lens_ptr, ln_sr, mk_ptr, mk_sr, since_ptr, seq_ptr, e_ptr, e_sr, e_sh,
                         num_kv_heads, we, depth, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    r = pid // num_kv_heads
    h = pid % num_kv_heads
    r64 = r.to(tl.int64)
    row = l_ptr + r64 * l_sr + h * l_sh
    n = tl.load(lens_ptr + r64 * ln_sr + h)
    b_len = tl.load(mk_ptr + r64 * mk_sr + h * 2)
    s_end = tl.load(mk_ptr + r64 * mk_sr + h * 2 + 1)
    since = tl.load(since_ptr + r).to(tl.int32)
    seq = tl.load(seq_ptr + r).to(tl.int32)
    e_row = e_ptr + r64 * e_sr + h * e_sh
    for c0 in range(0, we, BLOCK):
        i = c0 + tl.arange(0, BLOCK)
        t = tl.load(e_row + i, mask=i < we, other=-1)
        # below since (from since on: the tail's), neither in the base (ascending) nor a slash key (descending)
        valid = (t >= 0) & (t < since) & (t < seq)
        keep = valid & ~in_sorted(row, t, b_len, depth, BLOCK) & ~_in_descending(row + b_len, t, s_end - b_len,
                                                                                 depth, BLOCK)
        k = keep.to(tl.int32)
        tl.store(row + n + tl.cumsum(k, 0) - k, t, mask=keep)
        n += tl.sum(k, 0)
    tl.store(lens_ptr + r64 * ln_sr + h, n)


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
                lens_out: torch.Tensor | None = None, block: int | None = None, marks_out: torch.Tensor | None = None,
                zero_fill: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Every layer's decode lists of a step without re-selection (module docstring): ``(lists [L, R, Hk, W] int32,
    lens [L, R, Hk] int32)``, ``W = Wa + Ws + max_since``. ``out`` / ``lens_out``: preallocated outputs (``out``
    ``[L, R, Hk, >= W]`` with a contiguous last dim; the first ``W`` columns are written). One launch.

    ``marks_out [L, R, Hk, 2]`` int32: where each list's base ends and where its slash keys end, for a re-selection
    step's :func:`lines_append` (which needs the offsets of ``s_idx`` ascending in each row, ``-1`` after them: the
    slash keys then come out strictly descending). ``zero_fill`` False: nothing is written after each list's
    ``lens`` entries, and with ``out`` given its width is the caller's bound on every list's length (a CUDA graph's
    static width, at least the longest context; room for the entries :func:`lines_append` adds), not ``W``.
    ``block``: entries per program iteration (a power of two; the output does not depend on it; default
    :func:`union_block` of the launch's ``L * R * Hk`` programs)."""
    _check(base, base_lens, s_idx, since, seq_lens)
    r, n_l, hk, wa = base.shape
    ws = s_idx.shape[3]
    w = wa + ws + max(int(max_since), 0)
    dev = base.device
    if out is None:
        out = torch.empty(n_l, r, hk, w, dtype=torch.int32, device=dev)
    elif out.dtype != torch.int32 or tuple(out.shape[:3]) != (n_l, r, hk) or out.stride(3) != 1 or (
            zero_fill and out.shape[3] < w):
        raise ValueError(f"out must be [{n_l}, {r}, {hk}, >= {w}] int32 with a contiguous last dim")
    if zero_fill:
        out = out[..., :w]
    if lens_out is None:
        lens_out = torch.empty(n_l, r, hk, dtype=torch.int32, device=dev)
    elif lens_out.dtype != torch.int32 or tuple(lens_out.shape) != (n_l, r, hk) or lens_out.stride(2) != 1:
        raise ValueError(f"lens_out must be [{n_l}, {r}, {hk}] int32 with a contiguous last dim")
    if marks_out is not None and (marks_out.dtype != torch.int32 or tuple(marks_out.shape) != (n_l, r, hk, 2)
                                  or marks_out.stride(3) != 1 or marks_out.stride(2) != 2):
        raise ValueError(f"marks_out must be [{n_l}, {r}, {hk}, 2] int32 with contiguous last two dims")
    if r * n_l * hk == 0:
        return out, lens_out
    assert base.stride(3) == 1 and s_idx.stride(3) == 1 and base_lens.stride(2) == 1
    assert since.is_contiguous() and seq_lens.is_contiguous()
    mk = marks_out if marks_out is not None else lens_out.view(n_l, r, hk, 1)  # placeholder when not written
    block = block or union_block(n_l * r * hk)
    _lines_union_kernel[(n_l * r * hk,)](
        base, base.stride(0), base.stride(1), base.stride(2), base_lens, base_lens.stride(0), base_lens.stride(1),
        s_idx, s_idx.stride(0), s_idx.stride(1), s_idx.stride(2),
        since, seq_lens,
        out, out.stride(0), out.stride(1), out.stride(2), lens_out, lens_out.stride(0), lens_out.stride(1),
        mk, mk.stride(0), mk.stride(1),
        r, hk, wa, ws, out.shape[3], max(wa, 1).bit_length(), max(ws, 1).bit_length(), BLOCK=block,
        HAS_MARKS=marks_out is not None, ZERO_FILL=zero_fill, num_warps=_warps(block))
    return out, lens_out


def lines_append(lists: torch.Tensor, lens: torch.Tensor, marks: torch.Tensor, since: torch.Tensor,
                 seq_lens: torch.Tensor, extra: torch.Tensor, *, block: int = BLOCK) -> None:
    """A re-selection step, one layer: appends to each list of :func:`lines_union` (built with ``marks_out``) the
    positions of its new top-B ``extra [R, Hk, We]`` int32 (``-1`` padded, distinct per list) that it lacks: below
    ``since`` (the tail holds the rest), not in the base (ascending, ``marks[..., 0]`` entries), not a slash key
    (the next ``marks[..., 1] - marks[..., 0]`` entries, descending). In place: ``lists [R, Hk, W]`` int32 (room
    for ``We`` more entries per list), ``lens [R, Hk]`` int32; ``marks [R, Hk, 2]`` int32; ``since`` / ``seq_lens``
    ``[R]`` int32 or int64. One launch of ``R * Hk`` programs, no host sync; the set is the union with no position
    twice (the order: the list's, then the new entries in ``extra``'s order)."""
    r, hk, w = lists.shape
    we = extra.shape[2]
    if lens.shape != (r, hk) or marks.shape != (r, hk, 2) or extra.shape[:2] != (r, hk) or any(
            t.dtype != torch.int32 for t in (lists, lens, marks, extra)) or since.shape != (r,) or seq_lens.shape != (r,):
        raise ValueError(f"shapes / dtypes do not match: lists {tuple(lists.shape)}, lens {tuple(lens.shape)}, marks "
                         f"{tuple(marks.shape)}, extra {tuple(extra.shape)} (int32), since / seq_lens "
                         f"{tuple(since.shape)} / {tuple(seq_lens.shape)}")
    if r * hk * we == 0:
        return
    assert lists.stride(2) == 1 and extra.stride(2) == 1 and lens.stride(1) == 1 and marks.stride(2) == 1
    assert marks.stride(1) == 2 and since.is_contiguous() and seq_lens.is_contiguous()
    _lines_append_kernel[(r * hk,)](lists, lists.stride(0), lists.stride(1), lens, lens.stride(0), marks,
                                    marks.stride(0), since, seq_lens, extra, extra.stride(0), extra.stride(1), hk, we,
                                    max(w, 1).bit_length(), BLOCK=block, num_warps=_warps(block))


def lines_append_reference(lists: torch.Tensor, lens: torch.Tensor, since: torch.Tensor, seq_lens: torch.Tensor,
                           extra: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch reference of :func:`lines_append` (returns new tensors; the same order)."""
    out, new_lens = lists.clone().cpu(), lens.clone().cpu()
    for j in range(lists.shape[0]):
        lo, n = int(since[j]), int(seq_lens[j])
        for h in range(lists.shape[1]):
            m = int(new_lens[j, h])
            have = set(out[j, h, :m].tolist())
            add = [t for t in extra[j, h].tolist() if 0 <= t < min(lo, n) and t not in have]
            out[j, h, m: m + len(add)] = torch.tensor(add, dtype=torch.int32)
            new_lens[j, h] = m + len(add)
    return out.to(lists.device), new_lens.to(lists.device)


def lines_union_reference(base: torch.Tensor, base_lens: torch.Tensor, s_idx: torch.Tensor, since: torch.Tensor,
                          seq_lens: torch.Tensor, *, max_since: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch reference of :func:`lines_union` (same layout and order; zeros after ``lens``), a loop over
    (row, layer, head)."""
    _check(base, base_lens, s_idx, since, seq_lens)
    r, n_l, hk, wa = base.shape
    w = wa + s_idx.shape[3] + max(int(max_since), 0)
    out = torch.zeros(n_l, r, hk, w, dtype=torch.int32)
    lens = torch.zeros(n_l, r, hk, dtype=torch.int32)
    for j in range(r):
        lo, n = int(since[j]), int(seq_lens[j])
        p = n - 1
        for layer in range(n_l):
            for h in range(hk):
                b = base[j, layer, h, : int(base_lens[j, layer, h])].cpu()
                have = set(b.tolist())
                offs = s_idx[j, layer, h].tolist()
                offs = offs[: offs.index(-1)] if -1 in offs else offs  # the list's offsets end at its first -1
                slash = [p - s for s in offs if s >= 0 and 0 <= p - s < min(lo, n)]
                tail = list(range(lo, n))
                new = [t for t in slash + tail if t not in have]
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
