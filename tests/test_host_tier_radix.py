"""HostTierRadixCache on SGLang's real RadixCache, KV pool and allocator (CPU, no server): evicted nodes
go to the host tier, a later match reports them as host hits, init_load_back brings their KV back bit for
bit into fresh slots and inserts them; the stock size accounting (available + evictable + protected ==
pool size, the idle leak check's invariant) holds after every step; page sizes 1 and 4."""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")

from sglang.srt.mem_cache.base_prefix_cache import (  # noqa: E402
    EvictParams, InitLoadBackParams, InsertParams, MatchPrefixParams)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402

from radix_sparse.host_pool import HostTierConfig  # noqa: E402
from sglang_sparse.host_tier.cache import HostTier, HostTierRadixCache  # noqa: E402

LAYERS, HEADS, DIM, SIZE = 3, 2, 8, 64


def _make(page: int, host_gb: float = 0.01, line_budget: int = 0):
    kv = MHATokenToKVPool(SIZE, page, torch.bfloat16, HEADS, DIM, LAYERS, "cpu", False)
    if page == 1:
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

        alloc = TokenToKVPoolAllocator(SIZE, torch.bfloat16, "cpu", kv, False)
    else:
        from sglang_sparse_cpu_runtime.allocator import TorchPagedTokenToKVPoolAllocator

        alloc = TorchPagedTokenToKVPoolAllocator(SIZE, page, torch.bfloat16, "cpu", kv, False)
    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc,
                             page_size=page)
    tier = HostTier(HostTierConfig(host_tier_gb=host_gb, gpu_cache_mb=0.05, page_size=page), alloc,
                    line_budget=line_budget)
    return HostTierRadixCache(params, tier), kv, alloc


def _fill(kv, slots: torch.Tensor, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for layer in range(LAYERS):
        kv.k_buffer[layer][slots] = torch.randn(len(slots), HEADS, DIM, generator=g).to(torch.bfloat16)
        kv.v_buffer[layer][slots] = torch.randn(len(slots), HEADS, DIM, generator=g).to(torch.bfloat16)


def _kv(kv, slots):
    return [torch.stack([kv.k_buffer[i][slots], kv.v_buffer[i][slots]]) for i in range(LAYERS)]


def _accounting_ok(tree, alloc) -> bool:
    return alloc.available_size() + tree.evictable_size() + tree.protected_size() == SIZE


def _insert(tree, alloc, kv, tokens, seed):
    slots = alloc.alloc(len(tokens))
    assert slots is not None
    _fill(kv, slots, seed)
    res = tree.insert(InsertParams(key=RadixKey(array("q", tokens)), value=slots))
    alloc.free(slots[: res.prefix_len])  # duplicates of the cached prefix, as cache_finished_req does
    return slots


def _req(tokens, tree):
    r = SimpleNamespace(full_untruncated_fill_ids=array("q", tokens), extra_key=None, priority=0,
                        host_hit_length=0)
    m = tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens), limit=len(tokens) - 1), req=r))
    r.prefix_indices, r.last_node, r.host_hit_length = m.device_indices, m.last_device_node, m.host_hit_length
    return r, m


@pytest.mark.parametrize("page", [1, 4])
def test_evicted_node_is_reloaded_bit_exact(page):
    tree, kv, alloc = _make(page)
    a = list(range(100, 132))                 # 32 tokens: shared prefix + A's tail
    b = a[:8] + list(range(500, 524))         # shares the first 8 tokens with a
    slots_a = _insert(tree, alloc, kv, a, 1)
    want = _kv(kv, slots_a)
    _insert(tree, alloc, kv, b, 2)
    assert _accounting_ok(tree, alloc)
    # evict everything that is evictable: leaves first, then the shared prefix
    tree.evict(EvictParams(num_tokens=SIZE))
    assert tree.evictable_size() == 0 and _accounting_ok(tree, alloc)
    st = tree.tier.stats
    assert st.saved_nodes == 3 and st.saved_tokens == 8 + 24 + 24
    # scribble over the freed slots: a reload must not read them
    _fill(kv, torch.arange(SIZE), 99)
    query = a + [7, 7, 7, 7]
    r, m = _req(query, tree)
    assert len(m.device_indices) == 0 and m.host_hit_length == len(a)  # chain: prefix entry + A's tail
    new, last = tree.init_load_back(InitLoadBackParams(best_match_node=m.best_match_node,
                                                       host_hit_length=m.host_hit_length, req=r))
    assert len(new) == len(a) and r.host_hit_length == len(a)
    got = _kv(kv, new)
    assert all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(got, want))
    assert _accounting_ok(tree, alloc)
    # the reloaded tokens are ordinary tree nodes again: a plain match finds them on the device
    m2 = tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", query))))
    assert torch.equal(m2.device_indices, new) and last is m2.last_device_node
    assert tree.tier.stats.loaded_tokens == len(a) and tree.tier.stats.loaded_nodes == 2
    # evicting them again needs no save (the host copy is still there)
    tree.evict(EvictParams(num_tokens=SIZE))
    assert tree.tier.stats.save_skipped_nodes >= 1 and tree.tier.stats.saved_nodes == 3
    assert _accounting_ok(tree, alloc)
    # and the second reload goes through the GPU unit cache, whose units are still there (hits)
    r, m = _req(query, tree)
    hits0 = tree.tier.pool.stats().hits
    new2, _ = tree.init_load_back(InitLoadBackParams(best_match_node=m.best_match_node,
                                                     host_hit_length=m.host_hit_length, req=r))
    assert tree.tier.pool.stats().hits > hits0
    assert all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(_kv(kv, new2), want))
    tree.tier.close()


def test_partial_host_hit_and_no_hit_without_req():
    tree, kv, alloc = _make(1)
    a = list(range(10, 40))
    slots = _insert(tree, alloc, kv, a, 3)
    want = _kv(kv, slots)
    tree.evict(EvictParams(num_tokens=SIZE))
    # internal matches (no req) never report host hits
    m = tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", a))))
    assert m.host_hit_length == 0
    # a query that diverges after 12 tokens loads only those 12
    q = a[:12] + [1, 2, 3]
    r, m = _req(q, tree)
    assert m.host_hit_length == 12
    new, _ = tree.init_load_back(InitLoadBackParams(best_match_node=m.best_match_node, host_hit_length=12, req=r))
    assert len(new) == 12
    assert all(torch.equal(x.view(torch.int16), y[:, :12].view(torch.int16)) for x, y in zip(_kv(kv, new), want))
    assert _accounting_ok(tree, alloc)
    tree.tier.close()


def test_load_evicts_other_leaves_and_host_lru_drops_old_entries():
    # host pool of ~2 nodes of 24 tokens: the third eviction drops the least recently used entry
    block = LAYERS * HEADS * 2 * DIM * 2
    tree, kv, alloc = _make(1, host_gb=(50 * block) / 2**30)
    seqs = [list(range(1000 * i, 1000 * i + 24)) for i in range(1, 4)]
    for i, s in enumerate(seqs):
        _insert(tree, alloc, kv, s, 10 + i)
        tree.evict(EvictParams(num_tokens=SIZE))
    assert tree.tier.store.dropped == 1 and len(tree.tier.store) == 2
    r, m = _req(seqs[0] + [5], tree)
    assert m.host_hit_length == 0                      # dropped: recomputed
    # fill the device with an evictable node, then reload seqs[2]: the load must evict it
    _insert(tree, alloc, kv, list(range(7000, 7000 + SIZE - 8)), 20)
    r, m = _req(seqs[2] + [5], tree)
    assert m.host_hit_length == 24
    new, _ = tree.init_load_back(InitLoadBackParams(best_match_node=m.best_match_node, host_hit_length=24, req=r))
    assert len(new) == 24 and _accounting_ok(tree, alloc)
    tree.tier.close()


# ------------------------------------------------------------------ LoopServe line sets travel with the node
def _lines(start, end, verts, slashes):
    """TurnLines of 2 layers x 1 head: layer 0 gets ``verts``, layer 1 the first of them."""
    from radix_sparse.line_store import TurnLines

    w = len(verts)
    v = torch.full((2, 1, w), -1, dtype=torch.int32)
    v[0, 0] = torch.tensor(verts, dtype=torch.int32)
    v[1, 0, 0] = verts[0]
    s = torch.tensor(slashes, dtype=torch.int32).reshape(1, 1, -1).repeat(2, 1, 1)
    return TurnLines(start, end, v, torch.tensor([[w], [1]], dtype=torch.int32), s,
                     torch.full((2, 1), len(slashes), dtype=torch.int32))


def _as_lists(entries) -> dict:
    return {t: ([ln.v_idx[i, 0, : int(ln.v_cnt[i, 0])].tolist() for i in range(2)],
                ln.s_idx[0, 0, : int(ln.s_cnt[0, 0])].tolist()) for t, ln in entries.items()}


@pytest.mark.parametrize("page", [1, 4])
def test_loopserve_lines_move_to_host_and_back_with_their_nodes(page):
    from sglang_sparse.loopserve import radix as loopserve_radix

    radix = loopserve_radix.RadixLines(SimpleNamespace(line_store_mb=1),
                                       SimpleNamespace(line_store_bytes=0, stored_turns=0), None)
    tree, kv, alloc = _make(page, line_budget=1 << 20)
    setattr(tree, loopserve_radix.LINES_ATTR, radix)  # as runtime_hooks.scheduler_init_hook puts it there
    a = list(range(100, 132))                 # nodes: shared prefix [0, 8), A's tail [8, 32), B's tail
    b = a[:8] + list(range(500, 524))
    _insert(tree, alloc, kv, a, 1)
    _insert(tree, alloc, kv, b, 2)
    tail = tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", a)))).last_device_node
    prefix_node = tail.parent
    assert len(prefix_node.key) == 8 and len(tail.key) == 24
    # turn t [0, 32) split at 8 (its slashes and verticals < 8 on the prefix node), turn u [8, 32) on A's tail
    radix.store.attach(prefix_node.id, "t", _lines(0, 32, [1, 6], [0, 3]))
    radix.store.attach(tail.id, "t", _lines(0, 32, [12, 29], []))
    radix.store.attach(tail.id, "u", _lines(8, 32, [9, 20], [2]))
    held = radix.store.bytes
    tree.evict(EvictParams(num_tokens=SIZE))
    st = tree.tier.stats
    assert radix.store.num_entries == 0 and radix.store.bytes == 0      # they left the device store ...
    rep = tree.tier.report()                                           # ... for the host, bytes accounted
    assert st.saved_nodes == 3 and st.line_turns_saved == 3 and rep["host_line_turns"] == 3
    assert rep["host_line_bytes"] == held and rep["host_line_nodes"] == 2
    assert all(ln.v_idx.device.type == "cpu" for k in list(tree.tier.lines._lines)
               for _, ln in tree.tier.lines.get(k).turns)

    # a reload of all of A: one new node [0, 32) holds the union, positions unchanged
    r, m = _req(a + [7, 7, 7, 7], tree)
    _, last = tree.init_load_back(InitLoadBackParams(best_match_node=m.best_match_node,
                                                     host_hit_length=m.host_hit_length, req=r))
    assert len(last.key) == 32 and last.parent is tree.root_node
    assert _as_lists(radix.store.entries(last.id)) == {"t": ([[1, 6, 12, 29], [1, 12]], [0, 3]),
                                                       "u": ([[9, 20], [9]], [2])}
    assert st.line_turns_restored == 2 and st.line_turns_dropped == 0 and st.line_mismatches == 0
    # the request side (LoopServe's lookup over the matched path) sees them
    v_idx, v_cnt, s_idx, s_cnt = radix.lookup(SimpleNamespace(last_node=last), 32)
    assert v_idx[0, 0, : int(v_cnt[0, 0])].tolist() == [1, 6, 9, 12, 20, 29]
    assert s_idx[0, 0, : int(s_cnt[0, 0])].tolist() == [0, 2, 3]

    # evicted again: the KV is on the host already (no save), the lines replace the two entries' (split at 8)
    tree.evict(EvictParams(num_tokens=SIZE))
    assert st.saved_nodes == 3 and st.save_skipped_nodes >= 1 and radix.store.num_entries == 0
    assert tree.tier.report()["host_line_turns"] == 3 and tree.tier.lines.bytes <= held + 64

    # a reload stopping inside A's tail entry (12 tokens): the split rule's part before 12
    q = a[:12] + [1, 2, 3]
    r, m = _req(q, tree)
    assert m.host_hit_length == 12
    _, last = tree.init_load_back(InitLoadBackParams(best_match_node=m.best_match_node, host_hit_length=12, req=r))
    assert len(last.key) == 12
    assert _as_lists(radix.store.entries(last.id)) == {"t": ([[1, 6], [1]], [0, 3]), "u": ([[9], [9]], [2])}
    assert _accounting_ok(tree, alloc)

    # host entries dropped (here: all, by a reset) take their lines along
    tree.evict(EvictParams(num_tokens=SIZE))
    tree.tier.store.clear()
    assert tree.tier.lines.bytes == 0 and tree.tier.report()["host_line_turns"] == 0
    tree.tier.close()


def test_lines_of_an_unsaved_node_are_dropped_and_counted():
    from sglang_sparse.loopserve import radix as loopserve_radix

    radix = loopserve_radix.RadixLines(SimpleNamespace(line_store_mb=1),
                                       SimpleNamespace(line_store_bytes=0, stored_turns=0), None)
    tree, kv, alloc = _make(1, line_budget=0)       # no host room for lines: the KV goes, the lines do not
    setattr(tree, loopserve_radix.LINES_ATTR, radix)
    a = list(range(10, 40))
    _insert(tree, alloc, kv, a, 3)
    node = tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", a)))).last_device_node
    radix.store.attach(node.id, "t", _lines(0, 30, [1, 20], [0]))
    tree.evict(EvictParams(num_tokens=SIZE))
    st = tree.tier.stats
    assert st.saved_nodes == 1 and st.line_turns_saved == 0 and st.line_turns_dropped == 1
    assert radix.store.num_entries == 0 and tree.tier.lines.bytes == 0
    r, m = _req(a + [1], tree)
    _, last = tree.init_load_back(InitLoadBackParams(best_match_node=m.best_match_node,
                                                     host_hit_length=m.host_hit_length, req=r))
    assert radix.store.entries(last.id) == {} and st.line_turns_restored == 0
    tree.tier.close()
