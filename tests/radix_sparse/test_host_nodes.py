"""HostNodeStore: path-addressed host entries of evicted radix nodes over a HostBlockPool (pure torch)."""

from __future__ import annotations

import pytest
import torch

from radix_sparse.host_nodes import HostNodeStore
from radix_sparse.host_pool import HostBlockPool, HostTierConfig, KVShape

SHAPE = KVShape(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32)
BLOCK = 2 * 2 * 2 * 2 * 4 * 4  # layers x heads x (k, v) x page 2 x head_dim x 4 bytes


def _store(blocks: int, page: int = 2) -> HostNodeStore:
    cfg = HostTierConfig(host_tier_gb=blocks * BLOCK * (page / 2) / 2**30, gpu_cache_blocks=64, page_size=page)
    return HostNodeStore(HostBlockPool(cfg, SHAPE))


def test_chain_partial_sibling_and_limit():
    s = _store(16)
    prefix = [1, 2, 3, 4]
    s.add(None, [], 0, prefix, s.reserve(2))                       # [0, 4)
    s.add(None, prefix, 4, [5, 6, 7, 8, 9, 10], s.reserve(3))      # [4, 10) after prefix
    s.add(None, prefix + [5, 6], 6, [20, 21], s.reserve(1))        # a sibling path continuing at 6
    q = prefix + [5, 6, 7, 8, 9, 10, 11]
    assert [(e.start, m) for e, m in s.find_chain(None, q, 0, len(q))] == [(0, 4), (4, 6)]
    assert [(e.start, m) for e, m in s.find_chain(None, q, 0, 9)] == [(0, 4), (4, 4)]  # limit, page-aligned
    q2 = prefix + [5, 6, 20, 21, 0]
    assert [(e.start, m) for e, m in s.find_chain(None, q2, 0, len(q2))] == [(0, 4), (4, 2), (6, 2)]
    assert s.find_chain("other", q, 0, len(q)) == []               # extra_key separates namespaces
    assert s.find_chain(None, [9] + q[1:], 0, len(q)) == []        # different first page
    assert s.covered(None, [], 0, prefix + [5, 6, 7, 8]) and not s.covered(None, [], 0, prefix + [5, 6, 0, 0])


def test_lru_drop_pins_and_refusal():
    s = _store(4)
    a = s.add(None, [], 0, [1, 1, 1, 1], s.reserve(2))
    b = s.add(None, [], 0, [2, 2, 2, 2], s.reserve(2))
    s.find_chain(None, [1, 1, 1, 1], 0, 4)                          # a is now the most recently used
    b.pins += 1
    assert s.reserve(3) is None and s.refused == 1                  # b pinned: only 2 blocks can be freed
    b.pins -= 1
    got = s.reserve(2)
    assert got is not None and s.dropped == 1 and len(s) == 1      # b (LRU) dropped, a kept
    assert s.find_chain(None, [1, 1, 1, 1], 0, 4)[0][0] is a
    assert s.bytes == s.pool.blocks_used * s.pool.block_bytes == 4 * s.pool.block_bytes
    with pytest.raises(ValueError):
        s.add(None, [], 0, [3, 3, 3], got)                         # not page-aligned
