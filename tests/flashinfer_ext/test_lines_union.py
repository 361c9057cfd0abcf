"""Contract: flashinfer_ext.loopserve.lines_union builds a steady decode step's lists for every layer at once with
exactly its pure-torch reference's lists and lengths, and as sets exactly what the sort-based
decode_union_lists gives for the same lines, top-B, sink and tail (no position twice); over empty bases, empty
offset lists, a top-B holding the first tail position, slash keys inside the tail, offsets past the position,
rows of different lengths, several blocks per list and one block per list (the lists do not depend on the block);
on the CPU under the Triton interpreter and on the GPU."""

from __future__ import annotations

import pytest
import torch

from flashinfer_ext.common.sparse_decode import decode_union_lists
from flashinfer_ext.loopserve.lines_union import BLOCK, lines_base, lines_union, lines_union_reference

SINK = 4


def _padded(rows, width):
    out = torch.full((len(rows), width), -1, dtype=torch.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.int32)
    return out


def _case(n_rows, n_l, hk, wv, ws, wb, seed):
    """Per row: prompt length, lines (verticals < prompt), slash offsets, top-B (< since + 1), pos/since/seq."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for j in range(n_rows):
        prompt = int(torch.randint(60, 400, (1,), generator=g))
        since = prompt + int(torch.randint(0, 40, (1,), generator=g))
        seq = since + 1 + int(torch.randint(0, 20, (1,), generator=g))
        v, s, tb = [], [], []
        for _ in range(n_l * hk):
            nv = int(torch.randint(0, wv + 1, (1,), generator=g))
            v.append(torch.randperm(prompt, generator=g)[:nv].sort().values.tolist())
            ns = int(torch.randint(0, ws + 1, (1,), generator=g))
            s.append(torch.randperm(seq + 5, generator=g)[:ns].tolist())  # some offsets past pos
            nb = int(torch.randint(0, wb + 1, (1,), generator=g))
            t = torch.randperm(since + 1, generator=g)[:nb].tolist()
            if nb and j == 0:
                t[0] = since  # a top-B chosen at the selection step holds the first tail position
            tb.append(t)
        if j == 1 and ws:  # slash keys inside the tail: offsets 0 and 1
            s[0] = [0, 1] + [x for x in s[0] if x > 1][: max(ws - 2, 0)]
        rows.append(dict(v=_padded(v, wv).view(n_l, hk, wv), s=_padded(s, ws).view(n_l, hk, ws),
                         tb=_padded(tb, wb).view(n_l, hk, wb), since=since, seq=seq))
    return rows


def _inputs(rows, device):
    bases = [lines_base(r["v"].to(device), r["tb"].to(device), SINK) for r in rows]
    wa = max(b.shape[2] for b, _ in bases)
    base = torch.zeros(len(rows), *bases[0][0].shape[:2], wa, dtype=torch.int32, device=device)
    for j, (b, _) in enumerate(bases):
        base[j, :, :, : b.shape[2]] = b
    lens = torch.stack([ln for _, ln in bases])
    s_idx = torch.stack([r["s"] for r in rows]).to(device)
    seq = torch.tensor([r["seq"] for r in rows], dtype=torch.int32, device=device)
    since = torch.tensor([r["since"] for r in rows], dtype=torch.int32, device=device)
    return base, lens, s_idx, seq - 1, since, seq, int((seq - since).max())


SHAPES = [(1, 1, 1, 4, 3, 2), (3, 2, 3, 40, 30, 16), (2, 3, 2, 300, 200, 90), (2, 1, 1, 0, 0, 0), (1, 2, 2, 5, 0, 7)]


BLOCKS = [32, BLOCK]  # several blocks per list (the SHAPES' widths are up to 300) and the default


def _check(shape, seed, device, block=BLOCK):
    rows = _case(*shape, seed)
    base, lens, s_idx, pos, since, seq, max_since = _inputs(rows, device)
    got, got_lens = lines_union(base, lens, s_idx, since, seq, max_since=max_since, block=block)
    want, want_lens = lines_union_reference(base, lens, s_idx, since, seq, max_since=max_since)
    assert torch.equal(got_lens.cpu(), want_lens.cpu())
    assert torch.equal(got.cpu(), want.cpu())
    n_l = shape[1]
    for j, r in enumerate(rows):
        for layer in range(n_l):
            old, old_lens = decode_union_lists(r["v"][layer][None], r["s"][layer][None], r["tb"][layer][None],
                                               pos[j: j + 1].cpu(), since[j: j + 1].cpu(), seq[j: j + 1].cpu(),
                                               sink_tokens=SINK, max_since=max_since)
            for h in range(shape[2]):
                new = got[layer, j, h, : int(got_lens[layer, j, h])].cpu().tolist()
                assert len(new) == len(set(new)), "a position twice"
                assert sorted(new) == old[0, h, : int(old_lens[0, h])].tolist()
                assert not got[layer, j, h, int(got_lens[layer, j, h]):].any()


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"r{s[0]}l{s[1]}h{s[2]}v{s[3]}s{s[4]}b{s[5]}" for s in SHAPES])
def test_lines_union_is_the_sorted_union_of_lines_top_b_sink_and_tail(shape, seed, block):
    _check(shape, seed, "cpu", block)


def test_lines_union_writes_into_given_buffers_and_validates():
    rows = _case(2, 2, 2, 20, 10, 8, 5)
    base, lens, s_idx, pos, since, seq, max_since = _inputs(rows, "cpu")
    w = base.shape[3] + s_idx.shape[3] + max_since
    out = torch.full((2, 2, 2, w + 7), 99, dtype=torch.int32)
    lens_out = torch.empty(2, 2, 2, dtype=torch.int32)
    # int64 lengths (the runner's packed per-row ints) are read as they are
    got, got_lens = lines_union(base, lens, s_idx, since.long(), seq.long(), max_since=max_since, out=out,
                                lens_out=lens_out)
    assert got.data_ptr() == out.data_ptr() and got_lens is lens_out
    want, want_lens = lines_union_reference(base, lens, s_idx, since, seq, max_since=max_since)
    assert torch.equal(out[..., :w], want) and torch.equal(lens_out, want_lens)
    assert (out[..., w:] == 99).all()  # columns past W untouched
    with pytest.raises(ValueError, match="out must be"):
        lines_union(base, lens, s_idx, since, seq, max_since=max_since, out=out[..., : w - 1])
    with pytest.raises(ValueError, match="s_idx must be int32"):
        lines_union(base, lens, s_idx.long(), since, seq, max_since=max_since)
    with pytest.raises(ValueError, match="shapes do not match"):
        lines_union(base, lens, s_idx, since[:1], seq, max_since=max_since)


def test_lines_base_is_sorted_unique_lines_top_b_and_sink():
    v = torch.tensor([[[5, 9, -1, -1], [2, 3, 4, -1]]], dtype=torch.int32)
    tb = torch.tensor([[[9, 1, 40], [-1, -1, -1]]], dtype=torch.int32)
    base, lens = lines_base(v, tb, 4)
    assert lens.tolist() == [[7, 5]]
    assert base[0, 0, :7].tolist() == [0, 1, 2, 3, 5, 9, 40] and not base[0, 0, 7:].any()
    assert base[0, 1, :5].tolist() == [0, 1, 2, 3, 4]
    base2, lens2 = lines_base(v, None, 0)
    assert lens2.tolist() == [[2, 3]] and base2[0, 0, :2].tolist() == [5, 9]


def _check_extra(shape, seed, device, zero_fill=True, block=BLOCK):
    """A re-selecting step: the bases hold no top-B (lines and sink); lines_union (with marks) builds every layer's
    lists, lines_append adds each layer's new top-B (some of it on slash keys, in the base or in the tail); the lists
    are the same sets as the sort-based build's, in the reference's order."""
    from flashinfer_ext.loopserve.lines_union import lines_append, lines_append_reference

    rows = _case(*shape, seed)
    g = torch.Generator().manual_seed(seed + 7)
    for r in rows:  # ascending offsets (-1 after), and a top-B entry on a slash key where there is one
        s_sorted = torch.where(r["s"] < 0, 1 << 30, r["s"]).sort(-1).values
        r["s"] = torch.where(s_sorted == 1 << 30, -1, s_sorted).to(torch.int32)
        pos = r["seq"] - 1
        for layer in range(shape[1]):
            for h in range(shape[2]):
                offs = [x for x in r["s"][layer, h].tolist() if 0 <= pos - x < r["since"]]
                if offs and r["tb"].shape[2]:
                    r["tb"][layer, h, int(torch.randint(0, r["tb"].shape[2], (1,), generator=g))] = pos - offs[0]
        r["tb"] = torch.stack([torch.stack([_dedup(r["tb"][layer, h]) for h in range(shape[2])])
                               for layer in range(shape[1])])
    no_topb = [dict(r, tb=torch.full_like(r["tb"], -1)) for r in rows]
    base, lens, s_idx, pos, since, seq, max_since = _inputs(no_topb, device)
    extra = torch.stack([r["tb"] for r in rows]).to(device)  # [R, L, Hk, We]
    n_l, hk = shape[1], shape[2]
    w = base.shape[3] + s_idx.shape[3] + max_since + extra.shape[3]
    out = torch.full((n_l, len(rows), hk, w), 77, dtype=torch.int32, device=device)
    marks = torch.empty(n_l, len(rows), hk, 2, dtype=torch.int32, device=device)
    got, got_lens = lines_union(base, lens, s_idx, since, seq, max_since=max_since, out=out, marks_out=marks,
                                zero_fill=zero_fill, block=block)
    want, want_lens = lines_union_reference(base, lens, s_idx, since, seq, max_since=max_since)
    assert torch.equal(got_lens.cpu(), want_lens.cpu())
    assert torch.equal(marks[..., 0].cpu(), lens.transpose(0, 1).cpu())  # the base ends where its lens says
    for layer in range(n_l):
        want_l, want_n = lines_append_reference(want[layer], want_lens[layer], since, seq, extra[:, layer])
        lines_append(out[layer], got_lens[layer], marks[layer], since, seq, extra[:, layer].contiguous(), block=block)
        assert torch.equal(got_lens[layer].cpu(), want_n.cpu())
        for j, r in enumerate(rows):
            old, old_lens = decode_union_lists(r["v"][layer][None], r["s"][layer][None], r["tb"][layer][None],
                                               pos[j: j + 1].cpu(), since[j: j + 1].cpu(), seq[j: j + 1].cpu(),
                                               sink_tokens=SINK, max_since=max_since)
            for h in range(hk):
                n = int(got_lens[layer, j, h])
                new = out[layer, j, h, :n].cpu().tolist()
                assert new == want_l[j, h, :n].cpu().tolist()
                assert len(new) == len(set(new)), "a position twice"
                assert sorted(new) == old[0, h, : int(old_lens[0, h])].tolist()


def test_lines_union_reads_a_lists_offsets_up_to_its_first_padding_entry():
    """Each list walks its own offsets (those before its first -1), not the batch's padded width: entries after
    the first -1 are padding, whatever they hold."""
    rows = _case(2, 2, 2, 30, 12, 6, 9)
    base, lens, s_idx, pos, since, seq, max_since = _inputs(rows, "cpu")
    want, want_lens = lines_union(base, lens, s_idx, since, seq, max_since=max_since)
    junk = s_idx.clone()
    for j in range(2):  # a junk offset after each list's first -1 (offset 2: a key below since for every row)
        for layer in range(2):
            for h in range(2):
                row = junk[j, layer, h]
                pad = (row < 0).nonzero()
                if pad.numel() and int(pad[0]) + 1 < row.numel():
                    row[int(pad[0]) + 1] = 2
    assert not torch.equal(junk, s_idx)
    got, got_lens = lines_union(base, lens, junk, since, seq, max_since=max_since)
    ref, ref_lens = lines_union_reference(base, lens, junk, since, seq, max_since=max_since)
    assert torch.equal(got_lens, want_lens) and torch.equal(got, want)
    assert torch.equal(ref_lens, want_lens) and torch.equal(ref, want)


def _dedup(t):
    """A top-B row with no position twice (later duplicates set to -1)."""
    seen, out = set(), []
    for x in t.tolist():
        out.append(-1 if x in seen else x)
        if x >= 0:
            seen.add(x)
    return torch.tensor(out, dtype=torch.int32)


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("zero_fill", [True, False], ids=["zero_fill", "no_fill"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"r{s[0]}l{s[1]}h{s[2]}v{s[3]}s{s[4]}b{s[5]}" for s in SHAPES])
def test_lines_union_adds_a_new_top_b_once_beside_slash_keys_base_and_tail(shape, zero_fill, block):
    _check_extra(shape, 4, "cpu", zero_fill, block)


def test_lines_union_without_zero_fill_takes_the_callers_width_and_leaves_the_rest():
    from flashinfer_ext.loopserve.lines_union import lines_append

    rows = _case(2, 2, 2, 20, 10, 8, 6)
    base, lens, s_idx, pos, since, seq, max_since = _inputs(rows, "cpu")
    want, want_lens = lines_union_reference(base, lens, s_idx, since, seq, max_since=max_since)
    width = int(seq.max())  # the longest context bounds every list
    out = torch.full((2, 2, 2, width), 99, dtype=torch.int32)
    got, got_lens = lines_union(base, lens, s_idx, since, seq, max_since=max_since, out=out, zero_fill=False)
    assert got.data_ptr() == out.data_ptr() and torch.equal(got_lens, want_lens)
    for idx in torch.cartesian_prod(torch.arange(2), torch.arange(2), torch.arange(2)).tolist():
        n = int(got_lens[tuple(idx)])
        assert torch.equal(out[tuple(idx)][:n], want[tuple(idx)][:n]) and (out[tuple(idx)][n:] == 99).all()
    with pytest.raises(ValueError, match="marks_out must be"):
        lines_union(base, lens, s_idx, since, seq, max_since=max_since, marks_out=torch.empty(2, 2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="shapes / dtypes do not match"):
        lines_append(out[0], got_lens[0], torch.zeros(2, 2, 2, dtype=torch.int32), since, seq,
                     torch.zeros(2, 2, 4, dtype=torch.int64))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", SHAPES, ids=[f"r{s[0]}l{s[1]}h{s[2]}v{s[3]}s{s[4]}b{s[5]}" for s in SHAPES])
def test_gpu_lines_union_is_the_sorted_union_of_lines_top_b_sink_and_tail(shape):
    for block in BLOCKS:
        _check(shape, 3, "cuda", block)
        _check_extra(shape, 3, "cuda", zero_fill=False, block=block)
