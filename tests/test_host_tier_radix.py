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
from sglang_sparse.host_tier import HostTier, HostTierRadixCache  # noqa: E402

LAYERS, HEADS, DIM, SIZE = 3, 2, 8, 64


def _make(page: int, host_gb: float = 0.01):
    kv = MHATokenToKVPool(SIZE, page, torch.bfloat16, HEADS, DIM, LAYERS, "cpu", False)
    if page == 1:
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

        alloc = TokenToKVPoolAllocator(SIZE, torch.bfloat16, "cpu", kv, False)
    else:
        from sglang_sparse_cpu_runtime.allocator import TorchPagedTokenToKVPoolAllocator

        alloc = TorchPagedTokenToKVPoolAllocator(SIZE, page, torch.bfloat16, "cpu", kv, False)
    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc,
                             page_size=page)
    tier = HostTier(HostTierConfig(host_tier_gb=host_gb, gpu_cache_mb=0.05, page_size=page), alloc)
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
