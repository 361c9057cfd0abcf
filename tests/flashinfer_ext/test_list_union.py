"""Contract: flashinfer_ext.loopserve.list_union.union_append gives exactly its pure-torch reference's lists and lengths (the
sorted part, then the extra entries that are valid, below the row's length and not already present, in their order;
zeros after the length) over partial sorted lists, empty lists, lists of one entry, overlapping and -1 padded extras,
several blocks per list; on the CPU under the Triton interpreter and on the GPU."""

from __future__ import annotations

import pytest
import torch

from flashinfer_ext.loopserve.list_union import union_append, union_append_reference


def _case(b, hk, ws, we, seed, device):
    g = torch.Generator().manual_seed(seed)
    ctx = max(2 * (ws + we), 8)
    seq = torch.randint(ctx // 2, ctx + 1, (b,), generator=g)
    lens = torch.randint(0, ws + 1, (b, hk), generator=g).to(torch.int32)
    if b * hk > 1:
        lens[0, 0] = 0              # an empty sorted part
        lens.view(-1)[-1] = min(1, ws)  # a one-entry sorted part
    sorted_lists = torch.zeros(b, hk, ws, dtype=torch.int32)
    extra = torch.full((b, hk, we), -1, dtype=torch.int32)
    for i in range(b):
        for h in range(hk):
            n = int(lens[i, h])
            pool = torch.randperm(int(seq[i]), generator=g)
            sorted_lists[i, h, :n] = pool[:n].sort().values.to(torch.int32)
            sorted_lists[i, h, n:] = torch.randint(0, 99, (ws - n,), generator=g).to(torch.int32)  # junk after lens
            # extras: half from the sorted part (overlap), half new; some past seq; some -1 padding
            k = int(torch.randint(0, we + 1, (1,), generator=g))
            cand = torch.cat([pool[: max(n, 1)][: k // 2], torch.arange(int(seq[i]), int(seq[i]) + 3),
                              pool[n: n + k]]).unique()
            cand = cand[torch.randperm(cand.numel(), generator=g)][:k]
            extra[i, h, : cand.numel()] = cand.to(torch.int32)
    return [t.to(device) for t in (sorted_lists, lens, extra, seq)]


SHAPES = [(1, 1, 1, 1), (2, 3, 40, 16), (3, 8, 300, 70), (1, 2, 600, 600), (2, 1, 5, 0), (2, 2, 0, 9)]


def _check(shape, seed, device):
    sl, ln, ex, seq = _case(*shape, seed, device)
    got, got_lens = union_append(sl, ln, ex, seq)
    want, want_lens = union_append_reference(sl, ln, ex, seq)
    assert torch.equal(got_lens.cpu(), want_lens.cpu())
    assert torch.equal(got.cpu(), want.cpu())
    # as sets: exactly the union of the valid parts
    for i in range(shape[0]):
        for h in range(shape[1]):
            n, ls = int(got_lens[i, h]), int(ln[i, h])
            e = ex[i, h].cpu()
            union = set(sl[i, h, :ls].tolist()) | {x for x in e.tolist() if 0 <= x < int(seq[i])}
            assert sorted(got[i, h, :n].tolist()) == sorted(union) and len(union) == n


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"b{s[0]}h{s[1]}s{s[2]}e{s[3]}" for s in SHAPES])
def test_union_append_matches_reference(shape, seed):
    _check(shape, seed, "cpu")


def test_union_append_writes_into_given_buffers_and_validates():
    sl, ln, ex, seq = _case(2, 3, 40, 16, 0, "cpu")
    out = torch.full((2, 3, 80), 7, dtype=torch.int32)
    lens = torch.empty(2, 3, dtype=torch.int32)
    got, got_lens = union_append(sl, ln, ex, seq, out=out, lens_out=lens)
    assert got.data_ptr() == out.data_ptr() and got_lens is lens
    want, want_lens = union_append_reference(sl, ln, ex, seq)
    assert torch.equal(got, want) and torch.equal(lens, want_lens)
    with pytest.raises(ValueError, match="int32"):
        union_append(sl, ln, ex.long(), seq)
    with pytest.raises(ValueError, match="out must be"):
        union_append(sl, ln, ex, seq, out=torch.empty(2, 3, 10, dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", SHAPES, ids=[f"b{s[0]}h{s[1]}s{s[2]}e{s[3]}" for s in SHAPES])
def test_gpu_union_append_matches_reference(shape):
    _check(shape, 0, "cuda")
