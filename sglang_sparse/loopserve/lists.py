"""The token lists a LoopServe / lastwindow decode step attends, planned once per step for
:class:`sglang_sparse.loopserve.runner.LoopServeRunner` (device work only, no host sync).

A row's set per layer and KV head is its stored lines (verticals; slash offsets taken at the current position),
its top-B, the sink and the tail since its last selection. Two plans:

* **steady step** (no row selects top-B: 15 of every ``n_d`` loopserve steps after the first selections, every
  lastwindow step after its first): :func:`steady_lists`. Each request keeps its *base* (verticals ∪ top-B ∪
  sink, sorted once per selection: :func:`flashinfer_ext.loopserve.lines_union.lines_base`), and
  :func:`flashinfer_ext.loopserve.lines_union.lines_union` adds the slash keys and the tail for every layer in one
  launch, no sort. The batch's padded base / offset tensors are kept between steps while the batch holds the same
  requests with the same bases (:class:`BaseRows`): a steady step of an unchanged batch copies nothing per row.
* **re-selection step** (some row selects): the top-B-independent candidates of every layer in one call
  (:func:`static_all_layers`), then each layer merges its new top-B (:func:`plan_union_append` for the kernel
  path's per-layer :func:`~flashinfer_ext.loopserve.list_union.union_append`); over
  ``LISTS_ALL_MAX_ENTRIES`` each layer builds its whole set (:func:`union_lists`).
"""

from __future__ import annotations

import torch

# the all-layer list build of an eager step holds ~4 int32 tensors of L x rows x Hk x width entries at once; above
# this many entries (~256 MiB each) the lists are built per layer instead. A graph-replayed steady step writes its
# lists straight into the graph's static buffers (steady_lists' out) and is not capped by it
LISTS_ALL_MAX_ENTRIES = 1 << 26

def by_layer(t: torch.Tensor) -> torch.Tensor:
    """``[nS, L, ...]`` -> ``[L * nS, ...]`` (layer-major: a layer's slice is contiguous)."""
    return t.transpose(0, 1).reshape(t.shape[0] * t.shape[1], *t.shape[2:])


def request_base(st, sink_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A request state's base ``(base [L, Hk, Wa] int32, lens [L, Hk] int32)``: its verticals ∪ top-B ∪ sink,
    sorted (:func:`~flashinfer_ext.loopserve.lines_union.lines_base`), built when first asked after a selection
    (the state drops it when its top-B changes)."""
    if st.base is None:
        from flashinfer_ext.loopserve.lines_union import lines_base

        st.base = lines_base(st.lines[0], st.topb, sink_tokens)
    return st.base


class BaseRows:
    """The padded per-row inputs of :func:`steady_lists` (``base [nS, L, Hk, Wa]``, ``base_lens [nS, L, Hk]``,
    ``s_idx [nS, L, Hk, Ws]``), rebuilt only when the batch's requests or one of their bases changed (keyed by
    each state's ``uid``, unique within the runner that made it, and ``base_version``). Owned by that runner.
    Memory: it holds the last steady batch's padded tensors (``rows x L x Hk x (Wa + Ws)`` int32, ~80 MiB for 32
    rows of 32k tokens at the default ``alpha``) until the next steady step of another batch replaces them."""

    def __init__(self):
        self._key = None
        self._tensors = None

    def get(self, states, sink_tokens: int):
        key = tuple((st.uid, st.base_version) for st in states)
        if key != self._key:
            self._tensors = pad_bases([request_base(st, sink_tokens) for st in states], states)
            self._key = key
        return self._tensors


def pad_bases(bases, states) -> tuple:
    """Per-row bases ``[(base [L, Hk, w], lens [L, Hk])]`` and the rows' slash offsets, padded: ``(base [nS, L, Hk,
    Wa] (zeros after), base_lens [nS, L, Hk], s_idx [nS, L, Hk, Ws] (-1 after))`` int32."""
    n_l, hk = bases[0][0].shape[:2]
    dev = bases[0][0].device
    wa = max(1, max(b.shape[2] for b, _ in bases))
    ws = max(1, max(st.lines[2].shape[2] for st in states))
    base = torch.zeros(len(states), n_l, hk, wa, dtype=torch.int32, device=dev)
    s_idx = torch.full((len(states), n_l, hk, ws), -1, dtype=torch.int32, device=dev)
    for j, ((b, _), st) in enumerate(zip(bases, states)):
        base[j, :, :, : b.shape[2]] = b
        s_idx[j, :, :, : st.lines[2].shape[2]] = st.lines[2]
    return base, torch.stack([ln for _, ln in bases]), s_idx


def steady_lists(rows: BaseRows, states, since, seq, *, sink_tokens: int, max_since: int, out: tuple | None = None):
    """Every layer's lists of a steady step: ``(lists [L, nS, Hk, W], lens [L, nS, Hk])`` int32 with
    ``W = Wa + Ws + max_since`` (:func:`~flashinfer_ext.loopserve.lines_union.lines_union`); ``since`` / ``seq``
    ``[nS]`` on the device (the step's position is ``seq - 1``). ``out``: a CUDA graph's static ``(lists [L, nS, Hk,
    Wg], lens [L, nS, Hk])`` written instead (``Wg`` at least every row's context: the graph's gate checks it; nothing
    is written after a list's length), returned as given."""
    from flashinfer_ext.loopserve.lines_union import lines_union

    base, base_lens, s_idx = rows.get(states, sink_tokens)
    if out is None:
        return lines_union(base, base_lens, s_idx, since, seq, max_since=max_since)
    lines_union(base, base_lens, s_idx, since, seq, max_since=max_since, out=out[0], lens_out=out[1], zero_fill=False)
    return out


def steady_width(rows: BaseRows, states, sink_tokens: int, max_since: int) -> int:
    """``W`` of :func:`steady_lists` for this batch (host ints; builds the padded inputs if needed)."""
    base, _, s_idx = rows.get(states, sink_tokens)
    return base.shape[3] + s_idx.shape[3] + max_since


def union_lists(d, lid: int, sink_tokens: int):
    """One layer's decode sets as lists ``([nS, Hk, W] int32, [nS, Hk] int32)`` (``W`` = the summed widths of the
    line / offset / top-B tensors + sink + the longest tail since the last selection; no context-wide tensor)
    from the step's padded tensors ``d["v"]``, ``d["s"]``, ``d["topb"]``."""
    from flashinfer_ext.common.sparse_decode import decode_union_lists

    return decode_union_lists(d["v"][:, lid], d["s"][:, lid], d["topb"][:, lid], d["pos"], d["since"], d["seq"],
                              sink_tokens=sink_tokens, max_since=d["max_since"])


def static_all_layers(d, sink_tokens: int):
    """Every layer's top-B-independent candidates (:func:`~flashinfer_ext.common.sparse_decode.decode_union_static`:
    lines, slash positions, sink, tail) in one call: ``[L, nS, Hk, Ws]`` int32."""
    from flashinfer_ext.common.sparse_decode import decode_union_static

    n_s, n_l = d["v"].shape[0], d["v"].shape[1]
    static = decode_union_static(by_layer(d["v"]), by_layer(d["s"]), d["pos"].repeat(n_l), d["since"].repeat(n_l),
                                 d["seq"].repeat(n_l), sink_tokens=sink_tokens, max_since=d["max_since"])
    return static.view(n_l, n_s, *static.shape[1:])


def plan_union_append(d) -> None:
    """A re-selection step on the kernel path: every layer's candidates sorted and deduplicated at once
    (``static_sorted [L, nS, Hk, Ws]`` / ``static_lens [L, nS, Hk]``) and the step's union buffers, reused by
    every layer (:func:`flashinfer_ext.loopserve.list_union.union_append`)."""
    from flashinfer_ext.common.sparse_decode import decode_union_merge

    static = d["static_all"]
    n_l, n_s, hk, ws = static.shape
    no_topb = static.new_empty(n_l * n_s, hk, 0)
    lists, lens = decode_union_merge(static.view(n_l * n_s, hk, ws), no_topb, d["seq32"].repeat(n_l))
    d["static_sorted"], d["static_lens"] = lists.view(n_l, n_s, hk, ws), lens.view(n_l, n_s, hk)
    d["union_buf"] = static.new_empty(n_s, hk, ws + d["topb"].shape[3])
    d["union_lens_buf"] = static.new_empty(n_s, hk)


def merge_all_layers(d):
    """Every layer's lists from the step's candidates and top-B, sorted: ``([L, nS, Hk, W], [L, nS, Hk])``
    (layer-major, so a layer's slice is contiguous for the decode kernels). The sort-based form of
    :func:`steady_lists`, kept as its reference."""
    from flashinfer_ext.common.sparse_decode import decode_union_merge

    static = d["static_all"]
    n_l, n_s = static.shape[0], static.shape[1]
    lists, lens = decode_union_merge(static.view(n_l * n_s, *static.shape[2:]), by_layer(d["topb"]),
                                     d["seq"].repeat(n_l))
    return lists.view(n_l, n_s, *lists.shape[1:]), lens.view(n_l, n_s, lens.shape[1])


def request_base0(st, sink_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's base without its top-B ``(base0 [L, Hk, Wa] int32, lens [L, Hk] int32)``: its verticals ∪ sink,
    sorted; the base of a row that re-selects (its old top-B is replaced). Built once (its lines never change)."""
    if st.base0 is None:
        from flashinfer_ext.loopserve.lines_union import lines_base

        st.base0 = lines_base(st.lines[0], None, sink_tokens)
    return st.base0


def select_bases(states, fire, sink_tokens: int) -> tuple:
    """The padded bases of a re-selecting step: ``(base [nS, L, Hk, Wa], base_lens [nS, L, Hk], s_idx [nS, L, Hk,
    Ws])`` int32, a re-selecting row's base without its old top-B (:func:`request_base0`), every other row's with it
    (:func:`request_base`); the offsets ascending per row (as the prefill compacts them), ``-1`` after."""
    return pad_bases([request_base0(st, sink_tokens) if f else request_base(st, sink_tokens)
                      for st, f in zip(states, fire)], states)


def plan_select_lists(d, bases, out: tuple | None = None) -> None:
    """A re-selecting step: every layer's lists before its new top-B (bases, slash keys, tail: one
    :func:`~flashinfer_ext.loopserve.lines_union.lines_union` launch, with the marks :func:`select_lists` needs) into
    ``d["sel_lists"] = (lists [L, nS, Hk, W], lens [L, nS, Hk], marks [L, nS, Hk, 2])`` int32, ``W`` with room for the
    step's top-B width; ``out``: a CUDA graph's static ``(lists, lens, marks)`` ``[L, >= nS, ...]`` (its width bounds
    every list: the graph's gate checks every context against it) written instead, nothing after a list's length."""
    from flashinfer_ext.loopserve.lines_union import lines_union

    base, base_lens, s_idx = bases
    n_s, n_l, hk = base.shape[:3]
    if out is None:
        w = base.shape[3] + s_idx.shape[3] + d["max_since"] + d["topb"].shape[3]
        dev = base.device
        out = (torch.empty(n_l, n_s, hk, w, dtype=torch.int32, device=dev),
               torch.empty(n_l, n_s, hk, dtype=torch.int32, device=dev),
               torch.empty(n_l, n_s, hk, 2, dtype=torch.int32, device=dev))
    lists, lens, marks = (t[:, :n_s] for t in out)
    lines_union(base, base_lens, s_idx, d["since"], d["seq"], max_since=d["max_since"], out=lists, lens_out=lens,
                marks_out=marks, zero_fill=False)
    d["sel_lists"] = (lists, lens, marks)


def select_lists(d, lid: int):
    """One layer's lists of a re-selecting step (:func:`plan_select_lists`) with the layer's new top-B
    (``d["topb"][:, lid]``, ``-1`` for rows that keep theirs: it is in their bases) appended in place where missing:
    one :func:`~flashinfer_ext.loopserve.lines_union.lines_append` launch, no sort; ``([nS, Hk, W], [nS, Hk])``."""
    from flashinfer_ext.loopserve.lines_union import lines_append

    lists, lens, marks = d["sel_lists"]
    lines_append(lists[lid], lens[lid], marks[lid], d["since"], d["seq32"], d["topb"][:, lid])
    return lists[lid], lens[lid]
