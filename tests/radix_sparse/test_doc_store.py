"""DocStore: unit tests and seeded random-operation property tests of its invariants.

Invariants checked after every operation: refcounts never negative and equal to a shadow count,
referenced entries never evicted, bytes == sum of the stored tensors' bytes <= budget, entries <=
max_entries, different salts never match, identical tokens + salt hit while stored, hits/misses
counted exactly.
"""

from __future__ import annotations

import random

import pytest
import torch

from radix_sparse import DocKey, DocStore, DocStoreConfig, doc_key

LAYERS, HEADS, DIM = 2, 2, 4


def _kv(n: int, dtype=torch.bfloat16, fill: float = 1.0):
    k = [torch.full((n, HEADS, DIM), fill, dtype=dtype) for _ in range(LAYERS)]
    v = [torch.full((n, HEADS, DIM), -fill, dtype=dtype) for _ in range(LAYERS)]
    return k, v


def _nbytes(n: int, itemsize: int = 2) -> int:
    return 2 * LAYERS * n * HEADS * DIM * itemsize


def test_config_validation_names_field_and_range():
    with pytest.raises(ValueError, match=r"byte_budget=-1 .*\[0, "):
        DocStoreConfig(byte_budget=-1)
    with pytest.raises(ValueError, match=r"max_entries=0 .*\[1, "):
        DocStoreConfig(max_entries=0)
    with pytest.raises(ValueError, match="byte_budget"):
        DocStoreConfig(byte_budget=True)
    with pytest.raises(ValueError, match="byte_budget"):
        DocStoreConfig(byte_budget=1.5)


def test_key_depends_on_tokens_and_salt():
    a = doc_key([1, 2, 3])
    assert a == doc_key(torch.tensor([1, 2, 3], dtype=torch.int32))
    assert a != doc_key([1, 2, 4]) and a != doc_key([1, 2, 3, 0])
    assert a != doc_key([1, 2, 3], "") and doc_key([1, 2, 3], "x") != doc_key([1, 2, 3], "y")
    assert a.num_tokens == 3 and doc_key([5], "s").salt == "s"
    with pytest.raises(ValueError, match="empty"):
        doc_key([])
    with pytest.raises(ValueError, match="cache_salt"):
        doc_key([1], 5)
    with pytest.raises(ValueError, match="token_ids"):
        doc_key([1.0, 2.0])


def test_insert_lookup_refcount_and_salts():
    store = DocStore(DocStoreConfig(byte_budget=10 * _nbytes(4)))
    k, v = _kv(4)
    e = store.insert([7, 8, 9, 10], k, v, cache_salt="alice")
    assert e is not None and e.num_tokens == 4 and e.position == 0 and e.num_layers == LAYERS
    assert store.bytes == _nbytes(4) == e.nbytes
    assert store.lookup([7, 8, 9, 10], "bob") is None
    assert store.lookup([7, 8, 9, 10]) is None
    got = store.lookup([7, 8, 9, 10], "alice")
    assert got is e and store.refcount(e.key) == 1
    # first writer wins; acquire through insert
    again = store.insert([7, 8, 9, 10], *_kv(4, fill=2.0), cache_salt="alice", acquire=True)
    assert again is e and store.refcount(e.key) == 2 and store.bytes == _nbytes(4)
    store.release(e.key)
    store.release(e.key)
    with pytest.raises(ValueError, match="refcount"):
        store.release(e.key)
    s = store.stats()
    assert (s.hits, s.misses, s.entries, s.inserts, s.referenced) == (1, 2, 1, 1, 0)
    with pytest.raises(ValueError, match=r"k\[1\]"):
        store.insert([1, 2], [torch.zeros(2, 1, 4), torch.zeros(3, 1, 4)], [torch.zeros(2, 1, 4)] * 2)
    with pytest.raises(ValueError, match="one tensor per layer"):
        store.insert([1, 2], [torch.zeros(2, 1, 4)], [])


def test_budget_refuses_and_protects_referenced():
    store = DocStore(DocStoreConfig(byte_budget=2 * _nbytes(4)))
    a = store.insert([1] * 4, *_kv(4), acquire=True)
    b = store.insert([2] * 4, *_kv(4))
    assert a and b and store.bytes == 2 * _nbytes(4)
    c = store.insert([3] * 4, *_kv(4))  # evicts b (unreferenced), not a
    assert c is not None and a.key in store and b.key not in store
    store.acquire(c.key)
    assert store.insert([4] * 4, *_kv(4)) is None  # everything referenced: refused, nothing evicted
    assert a.key in store and c.key in store and store.stats().refused == 1
    assert store.insert([5] * 9, *_kv(9)) is None  # larger than the budget
    store.release(c.key)
    assert store.evict(1) == _nbytes(4) and c.key not in store
    with pytest.raises(ValueError, match="referenced"):
        store.remove(a.key)


def test_max_entries_evicts_lru():
    store = DocStore(DocStoreConfig(byte_budget=1 << 20, max_entries=2))
    a = store.insert([1], *_kv(1))
    b = store.insert([2], *_kv(1))
    store.lookup([1], acquire=False)  # a becomes most recently used
    c = store.insert([3], *_kv(1))
    assert c is not None and a.key in store and b.key not in store and len(store) == 2


def _check_invariants(store: DocStore, shadow_refs: dict, cfg: DocStoreConfig, all_tensors: dict):
    total = 0
    for key in store.keys():
        entry = store.peek(key)
        assert entry is not None and entry.key == key
        total += sum(t.numel() * t.element_size() for t in entry.k + entry.v)
        assert store.refcount(key) == shadow_refs.get(key, 0) >= 0
        assert entry.k is all_tensors[key][0]  # stored tensors are the inserted ones
    assert store.bytes == total <= cfg.byte_budget
    assert len(store) <= cfg.max_entries
    for key, refs in shadow_refs.items():
        if refs > 0:
            assert key in store, "a referenced entry was evicted"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_operations_keep_invariants(seed):
    rng = random.Random(seed)
    cfg = DocStoreConfig(byte_budget=rng.choice([6, 20, 60]) * _nbytes(3), max_entries=rng.choice([4, 16, 64]))
    store = DocStore(cfg)
    docs = [[rng.randrange(50) for _ in range(rng.randint(1, 6))] for _ in range(10)]
    salts = [None, "a", "b"]
    shadow_refs: dict[DocKey, int] = {}
    tensors: dict[DocKey, tuple] = {}
    hits = misses = 0
    for _ in range(2500):
        op = rng.random()
        toks, salt = rng.choice(docs), rng.choice(salts)
        key = doc_key(toks, salt)
        if op < 0.3:  # insert
            was = key in store
            dtype = rng.choice([torch.bfloat16, torch.float32])
            k, v = _kv(len(toks), dtype=dtype)
            acq = rng.random() < 0.3
            entry = store.insert(toks, k, v, cache_salt=salt, acquire=acq)
            if entry is not None:
                assert entry.key == key
                if not was:
                    tensors[key] = (entry.k,)
                if acq:
                    shadow_refs[key] = shadow_refs.get(key, 0) + 1
            else:
                assert not was
        elif op < 0.6:  # lookup
            was = key in store
            acq = rng.random() < 0.5
            entry = store.lookup(toks, salt, acquire=acq)
            assert (entry is not None) == was
            if entry is not None:
                hits += 1
                assert entry.key == key and entry.key.salt == salt and entry.num_tokens == len(toks)
                # salts isolate: the same tokens under another salt are a different entry
                for other in salts:
                    if other != salt and doc_key(toks, other) in store:
                        assert store.peek(doc_key(toks, other)) is not entry
                if acq:
                    shadow_refs[key] = shadow_refs.get(key, 0) + 1
            else:
                misses += 1
        elif op < 0.9:  # release one held reference
            held = [kk for kk, r in shadow_refs.items() if r > 0]
            if held:
                kk = rng.choice(held)
                store.release(kk)
                shadow_refs[kk] -= 1
            elif key in store:
                with pytest.raises(ValueError):
                    store.release(key)
        elif op < 0.92:  # explicit evict
            before = store.bytes
            freed = store.evict(rng.randint(1, _nbytes(3)))
            assert store.bytes == before - freed
        else:  # remove
            if key in store:
                if shadow_refs.get(key, 0) > 0:
                    with pytest.raises(ValueError):
                        store.remove(key)
                else:
                    assert store.remove(key)
        for kk in list(shadow_refs):
            if shadow_refs[kk] == 0 and kk not in store:
                del shadow_refs[kk]
        _check_invariants(store, shadow_refs, cfg, tensors)
        s = store.stats()
        assert (s.hits, s.misses) == (hits, misses)
    final = store.stats()
    assert final.evictions > 0 and final.hits > 50 and final.misses > 0
