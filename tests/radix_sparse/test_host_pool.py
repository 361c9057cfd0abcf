"""HostBlockPool / GpuBlockCache: unit tests and seeded random-operation property tests.

A pure-python shadow model (dict unit -> slot, dict slot -> last-use tick, set of dirty slots,
set of allocated blocks) replays every operation; after each one the pool's maps, LRU order,
free/used slots, counters and byte accounting must equal the shadow's, and every cached slot
must hold the bytes of its host unit (gathered with the torch reference copy).
"""

from __future__ import annotations

import random

import pytest
import torch

from radix_sparse.host_pool import CacheFull, GpuBlockCache, HostBlockPool, HostTierConfig, KVShape

SHAPE = KVShape(num_layers=3, num_kv_heads=2, head_dim=4, dtype=torch.float16)
PAGE = 4
UNIT_BYTES = 2 * PAGE * 4 * 2
BLOCK_BYTES = 3 * 2 * UNIT_BYTES


def _pool(blocks: int = 10, slots: int = 8) -> HostBlockPool:
    cfg = HostTierConfig(host_tier_gb=blocks * BLOCK_BYTES / (1 << 30), gpu_cache_blocks=slots, page_size=PAGE)
    pool = HostBlockPool(cfg, SHAPE, device="cpu")
    # distinct content per unit so a wrong copy is visible
    pool.host_units.copy_(torch.arange(pool.host_units.numel()).view_as(pool.host_units).to(torch.float16))
    return pool


def test_config_validation_names_field_and_range():
    with pytest.raises(ValueError, match=r"host_tier_gb=0 .*\(0.0, 4096.0\]"):
        HostTierConfig(host_tier_gb=0, gpu_cache_blocks=1)
    with pytest.raises(ValueError, match=r"gpu_cache_blocks=0 / gpu_cache_mb=0.0: set exactly one"):
        HostTierConfig()
    with pytest.raises(ValueError, match="set exactly one"):
        HostTierConfig(gpu_cache_blocks=4, gpu_cache_mb=1.0)
    with pytest.raises(ValueError, match=r"gpu_cache_blocks=-1 .*\[0, "):
        HostTierConfig(gpu_cache_blocks=-1)
    with pytest.raises(ValueError, match=r"page_size=24 .*power of two in \[1, 256\]"):
        HostTierConfig(gpu_cache_blocks=1, page_size=24)
    with pytest.raises(ValueError, match=r"working_set_window=0 .*\[1, 256\]"):
        HostTierConfig(gpu_cache_blocks=1, working_set_window=0)
    with pytest.raises(ValueError, match="working_set_window"):
        HostTierConfig(gpu_cache_blocks=1, working_set_window=True)
    with pytest.raises(ValueError, match="KVShape.dtype"):
        KVShape(1, 1, 8, torch.int8)
    with pytest.raises(ValueError, match=r"host_tier_gb=1e-09 holds no block"):
        HostBlockPool(HostTierConfig(host_tier_gb=1e-9, gpu_cache_blocks=1), SHAPE, device="cpu")
    with pytest.raises(ValueError, match=r"gpu_cache_mb=1e-06 holds no unit"):
        HostBlockPool(HostTierConfig(host_tier_gb=0.001, gpu_cache_mb=1e-6), SHAPE, device="cpu")


def test_layout_sizes_and_unit_ids():
    pool = _pool(blocks=10, slots=8)
    assert pool.num_blocks == 10 and pool.unit_bytes == UNIT_BYTES and pool.block_bytes == BLOCK_BYTES
    assert pool.host_buf.shape == (3, 10, 2, 2, PAGE, 4) and pool.host_buf.is_contiguous()
    assert not pool.pinned  # no CUDA here
    # unit id (layer, block, head) addresses host_buf[layer, block, head] as one contiguous row
    u = pool.unit_ids(torch.tensor([7]), torch.tensor([2]), torch.tensor([1]))
    assert u.tolist() == [(2 * 10 + 7) * 2 + 1]
    assert torch.equal(pool.host_units[u[0]], pool.host_buf[2, 7, 1].flatten())
    lay, blk, hd = pool.unit_coords(pool.unit_ids(torch.tensor([3, 5])))
    assert sorted(set(blk.tolist())) == [3, 5] and lay.max() == 2 and hd.max() == 1
    cfg_mb = HostTierConfig(host_tier_gb=0.001, gpu_cache_mb=1.0, page_size=PAGE)
    assert HostBlockPool(cfg_mb, SHAPE, device="cpu").cache.capacity == (1 << 20) // UNIT_BYTES


def test_alloc_free_and_refusal():
    pool = _pool(blocks=4)
    a = pool.alloc(3)
    assert a.tolist() == [0, 1, 2] and pool.blocks_free == 1
    assert pool.alloc(2) is None and pool.blocks_free == 1  # refused, nothing taken
    pool.free(a[1:2])
    b = pool.alloc(2)
    assert sorted(b.tolist()) == [1, 3] and pool.blocks_free == 0
    pool.free(torch.tensor([0]))
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(torch.tensor([0]))
    with pytest.raises(ValueError, match="duplicate"):
        pool.free(torch.tensor([2, 2]))
    with pytest.raises(ValueError, match="out of range"):
        pool.free(torch.tensor([4]))
    st = pool.stats()
    assert st.host_blocks_used == 3 and st.host_bytes_used == 3 * BLOCK_BYTES
    assert st.host_bytes_total == 4 * BLOCK_BYTES


def test_lru_order_eviction_dirty_and_invalidate():
    pool = _pool(blocks=4, slots=4)
    pool.alloc(4)
    u = pool.unit_ids(torch.tensor([0, 1]), torch.tensor([0]))  # 4 units: (0,0,0) (0,0,1) (0,1,0) (0,1,1)
    p1 = pool.acquire(u[:3])
    assert p1.load_units.tolist() == u[:3].tolist() and p1.load_slots.tolist() == [0, 1, 2] and p1.hits == 0
    p2 = pool.acquire(u[1:2])  # touch u1: LRU order now slot0 (u0), slot2 (u2), slot1 (u1)
    assert p2.hits == 1 and p2.load_units.numel() == 0 and p2.slots.tolist() == [1]
    p3 = pool.acquire(u[3:4])  # free slot 3 first
    assert p3.load_slots.tolist() == [3]
    assert pool.cache.lru_order().tolist() == [0, 2, 1, 3]
    pool.cache.mark_dirty(u[0:1])
    v = pool.unit_ids(torch.tensor([2]), torch.tensor([0]))  # 2 new units -> evict slots 0 and 2
    p4 = pool.acquire(torch.cat([v, u[3:4]]))
    assert p4.load_slots.tolist() == [0, 2] and p4.hits == 1
    assert p4.save_slots.tolist() == [0] and p4.save_units.tolist() == [u[0].item()]  # dirty victim
    assert pool.cache.lookup(u).tolist() == [-1, 1, -1, 3]
    st = pool.stats()
    assert (st.hits, st.misses, st.evictions, st.saved_units) == (2, 6, 2, 1)
    assert st.loaded_bytes == 6 * UNIT_BYTES and st.resident_bytes == 4 * UNIT_BYTES
    assert abs(st.hit_rate - 2 / 8) < 1e-12
    # freeing block 2 drops its cached units (slots 0, 2 become free and are reused first)
    pool.free(torch.tensor([2]))
    assert pool.cache.slots_used == 2 and pool.cache.lookup(v).tolist() == [-1, -1]
    with pytest.raises(ValueError, match="not allocated"):
        pool.acquire(v)
    with pytest.raises(CacheFull):
        pool.acquire(pool.unit_ids(torch.tensor([0, 1, 3])))
    with pytest.raises(ValueError, match="distinct"):
        pool.acquire(torch.cat([u[:1], u[:1]]))
    with pytest.raises(ValueError, match="not cached"):
        pool.cache.mark_dirty(v)


def test_acquire_never_evicts_units_of_the_same_step():
    cache = GpuBlockCache(capacity=3, num_units=10, unit_elems=2, dtype=torch.float32)
    cache.acquire(torch.tensor([0, 1, 2]))
    p = cache.acquire(torch.tensor([2, 5]))  # 2 hits, 5 must evict the LRU of {0, 1}, not 2
    assert p.hits == 1 and p.load_slots.tolist() == [0]
    p = cache.acquire(torch.tensor([6, 1, 5]))  # LRU among slots not used now: slot 2 (unit 2)
    assert p.load_units.tolist() == [6] and p.load_slots.tolist() == [2]


def _gather_ref(pool: HostBlockPool, plan) -> None:
    """The torch reference of the fused gather: copy host rows to cache rows."""
    if plan.load_units.numel():
        pool.cache.cache_buf[plan.load_slots.long()] = pool.host_units[plan.load_units.long()]


class _Shadow:
    def __init__(self, pool: HostBlockPool):
        self.cap = pool.cache.capacity
        self.slot_of: dict[int, int] = {}
        self.stamp: dict[int, int] = {}  # slot -> tick (used slots only)
        self.dirty: set[int] = set()
        self.blocks: set[int] = set()
        self.tick = self.hits = self.misses = self.evictions = self.saved = 0

    def acquire(self, units: list[int]):
        self.tick += 1
        for u in units:
            if u in self.slot_of:
                self.stamp[self.slot_of[u]] = self.tick
        misses = [u for u in units if u not in self.slot_of]
        free = [s for s in range(self.cap) if s not in self.stamp]
        lru = sorted((t, s) for s, t in self.stamp.items() if t != self.tick)
        victims = (free + [s for _, s in lru])[:len(misses)]
        unit_at = {s: u for u, s in self.slot_of.items()}
        saves = []
        for u, s in zip(misses, victims):
            if s in unit_at:
                self.evictions += 1
                if s in self.dirty:
                    saves.append((s, unit_at[s]))
                    self.saved += 1
                del self.slot_of[unit_at[s]]
            self.dirty.discard(s)
            self.slot_of[u] = s
            self.stamp[s] = self.tick
        self.hits += len(units) - len(misses)
        self.misses += len(misses)
        return misses, victims, saves


def _check(pool: HostBlockPool, sh: _Shadow) -> None:
    c = pool.cache
    used = c.unit_of_slot_host >= 0
    assert torch.equal(used, c.last_use_host >= 0)  # free iff no stamp: no slot both free and used
    su = c.slot_of_unit_host
    cached = torch.nonzero(su >= 0).flatten()
    assert torch.equal(c.unit_of_slot_host[su[cached]], cached)  # maps are inverse
    assert int(used.sum()) == cached.numel()
    assert {int(u): int(su[u]) for u in cached} == sh.slot_of
    assert {int(s): int(c.last_use_host[s]) for s in torch.nonzero(used).flatten()} == \
        {s: sh.stamp[s] for s in sh.stamp}
    assert set(torch.nonzero(c.dirty_host).flatten().tolist()) == sh.dirty
    assert not bool(c.dirty_host[~used].any())
    if cached.numel():  # every cached unit belongs to an allocated block, and holds its bytes
        assert bool(pool.is_allocated(pool.unit_coords(cached)[1]).all())
        assert torch.equal(c.cache_buf[su[cached]], pool.host_units[cached])
    st = pool.stats()
    assert set(torch.nonzero(pool._used_host).flatten().tolist()) == sh.blocks
    assert st.host_blocks_used == len(sh.blocks) and st.host_bytes_used == len(sh.blocks) * pool.block_bytes
    assert st.resident_bytes == len(sh.slot_of) * pool.unit_bytes
    assert (st.hits, st.misses, st.evictions, st.saved_units) == (sh.hits, sh.misses, sh.evictions, sh.saved)
    assert st.loaded_bytes == sh.misses * pool.unit_bytes and st.saved_bytes == sh.saved * pool.unit_bytes


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_operations_keep_invariants(seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    pool = _pool(blocks=12, slots=rng.choice([5, 16, 40]))
    sh = _Shadow(pool)
    for _ in range(1500):
        op = rng.random()
        if op < 0.15:
            n = rng.randint(0, 4)
            got = pool.alloc(n)
            if n > 12 - len(sh.blocks):
                assert got is None
            else:
                assert len(set(got.tolist()) & sh.blocks) == 0
                sh.blocks |= set(got.tolist())
        elif op < 0.27 and sh.blocks:
            blocks = rng.sample(sorted(sh.blocks), rng.randint(1, min(3, len(sh.blocks))))
            pool.free(torch.tensor(blocks))
            sh.blocks -= set(blocks)
            dead = set(pool.unit_ids(torch.tensor(blocks)).tolist())
            for u in [u for u in sh.slot_of if u in dead]:
                s = sh.slot_of.pop(u)
                del sh.stamp[s]
                sh.dirty.discard(s)
        elif op < 0.37 and sh.slot_of:
            units = rng.sample(sorted(sh.slot_of), rng.randint(1, min(4, len(sh.slot_of))))
            pool.cache.mark_dirty(torch.tensor(units))
            sh.dirty |= {sh.slot_of[u] for u in units}
        elif sh.blocks:
            live = pool.unit_ids(torch.tensor(sorted(sh.blocks))).tolist()
            k = rng.randint(0, min(len(live), pool.cache.capacity + 2))
            units = rng.sample(live, k)
            if k > pool.cache.capacity:
                with pytest.raises(CacheFull):
                    pool.acquire(torch.tensor(units, dtype=torch.int64))
                continue
            plan = pool.acquire(torch.tensor(units, dtype=torch.int64))
            misses, victims, saves = sh.acquire(units)
            assert plan.load_units.tolist() == misses and plan.load_slots.tolist() == victims
            assert list(zip(plan.save_slots.tolist(), plan.save_units.tolist())) == saves
            assert plan.slots.tolist() == [sh.slot_of[u] for u in units]
            _gather_ref(pool, plan)
        _check(pool, sh)
