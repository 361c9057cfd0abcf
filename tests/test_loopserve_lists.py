"""Contract: a steady LoopServe decode step's padded inputs (loopserve.lists.BaseRows) are built once and kept while
the batch holds the same request states with the same bases, and rebuilt when a request joins or leaves or a
request's top-B changes (the runner drops its base and bumps base_version when it commits a new top-B); a base is
the sorted union of the request's verticals, top-B and sink."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from sglang_sparse.loopserve.lists import BaseRows, request_base

L, HK = 2, 3


def _state(uid, seed, wv=5, ws=4, wb=3):
    g = torch.Generator().manual_seed(seed)
    v = torch.randint(10, 200, (L, HK, wv), generator=g).sort(2).values.to(torch.int32)
    s = torch.randint(0, 50, (L, HK, ws), generator=g).to(torch.int32)
    tb = torch.randint(0, 300, (L, HK, wb), generator=g).to(torch.int32)
    return SimpleNamespace(uid=uid, base_version=0, base=None, lines=(v, None, s, None), topb=tb)


def test_padded_inputs_are_kept_while_the_batch_is_unchanged():
    rows = BaseRows()
    a, b = _state(1, 0), _state(2, 1, wv=7)
    first = rows.get([a, b], 4)
    assert rows.get([a, b], 4) is first  # unchanged batch: nothing rebuilt
    base, lens, s_idx = first
    assert base.shape == (2, L, HK, 4 + 7 + 3) and s_idx.shape == (2, L, HK, 4) and lens.shape == (2, L, HK)
    for j, st in enumerate((a, b)):
        for layer in range(L):
            for h in range(HK):
                want = sorted(set(st.lines[0][layer, h].tolist()) | set(st.topb[layer, h].tolist()) | set(range(4)))
                assert base[j, layer, h, : int(lens[j, layer, h])].tolist() == want
    assert rows.get([b, a], 4) is not first  # the rows moved
    assert rows.get([a], 4)[0].shape[0] == 1  # a request left


def test_a_new_top_b_rebuilds_that_requests_base():
    rows = BaseRows()
    a, b = _state(1, 0), _state(2, 1)
    first = rows.get([a, b], 4)
    a.topb = torch.full((L, HK, 3), 250, dtype=torch.int32)
    a.base, a.base_version = None, a.base_version + 1  # what the runner does when it commits a new top-B
    base, lens, _ = rows.get([a, b], 4)
    assert base is not first[0]
    assert 250 in base[0, 0, 0, : int(lens[0, 0, 0])].tolist()
    assert torch.equal(base[1], first[0][1]) and request_base(b, 4) is b.base  # the other request's base reused
