"""host_transfer: fused gather (Triton; CPU interpreter here, UVA from pinned memory on the GPU) and
CPU-assisted save are bit-identical to the row-copy references.

Bit-identity is checked on the raw 16/32-bit words of random bit patterns (NaNs and infinities
included), so a kernel that converted through float, dropped a row, shifted an offset or skipped a
chunk fails.
"""

from __future__ import annotations

import pytest
import torch

from flashinfer_ext.host_tier.host_transfer import (HostGather, HostSave, gather_units_reference, save_units_reference,
                                          word_view)
from radix_sparse.host_pool import HostBlockPool, HostTierConfig, KVShape

_INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def _random_bits(shape, dtype, gen, device="cpu"):
    it = _INT[dtype]
    lo, hi = torch.iinfo(it).min, torch.iinfo(it).max
    return torch.randint(lo, hi + 1, shape, dtype=it, generator=gen).view(dtype).to(device)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT[t.dtype])


def _ids(n_src, n_dst, n, gen, device="cpu", pad=0):
    src = torch.randint(0, n_src, (n,), generator=gen, dtype=torch.int64)
    dst = torch.randperm(n_dst, generator=gen)[:n]
    if pad:
        src = torch.cat([src, torch.full((pad,), -1, dtype=torch.int64)])
        dst = torch.cat([dst, torch.randperm(n_dst, generator=gen)[:pad]])
    return src.to(torch.int32).to(device), dst.to(torch.int32).to(device)


# ---------------------------------------------------------------- CPU (Triton interpreter)

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("page,head_dim,n", [(4, 8, 1), (4, 8, 7), (2, 6, 5), (16, 64, 3)])
def test_gather_interpreter_bit_identical(dtype, page, head_dim, n):
    gen = torch.Generator().manual_seed(page * 100 + head_dim + n)
    row = 2 * page * head_dim
    src = _random_bits((23, row), dtype, gen)
    dst = _random_bits((11, row), dtype, gen)
    want = dst.clone()
    s, d = _ids(23, 11, n, gen, pad=2)
    g = HostGather(src, dst, max_rows=16)
    assert g.path == "triton"
    g.run(s, d)
    gather_units_reference(src, s, want, d)
    assert torch.equal(_bits(dst), _bits(want))
    untouched = torch.ones(11, dtype=torch.bool)
    untouched[d[s >= 0].long()] = False
    assert untouched.any() and torch.equal(_bits(dst[untouched]), _bits(want[untouched]))


def test_gather_chunks_long_rows_and_odd_row_bytes():
    gen = torch.Generator().manual_seed(3)
    src = _random_bits((5, 2 * 64 * 40), torch.bfloat16, gen)  # 5120 elems = 2560 words: 2 chunks of 2048
    dst = torch.zeros((4, 2 * 64 * 40), dtype=torch.bfloat16)
    g = HostGather(src, dst, max_rows=4)
    assert g._chunks == 2
    s, d = torch.tensor([4, 0, 2], dtype=torch.int32), torch.tensor([1, 3, 0], dtype=torch.int32)
    g.run(s, d)
    want = torch.zeros_like(dst)
    gather_units_reference(src, s, want, d)
    assert torch.equal(_bits(dst), _bits(want))
    odd = torch.arange(3 * 3, dtype=torch.float16).view(3, 3)  # 6-byte rows move as int16
    assert word_view(odd).dtype == torch.int16
    out = torch.zeros_like(odd)
    HostGather(odd, out, max_rows=2).run(torch.tensor([2, 0], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32))
    assert torch.equal(out, torch.stack([odd[2], odd[0], torch.zeros(3, dtype=torch.float16)]))


def test_gather_from_host_pool_units():
    cfg = HostTierConfig(host_tier_gb=64 * 3 * 2 * 2 * 4 * 16 * 2 / (1 << 30), gpu_cache_blocks=9, page_size=4)
    pool = HostBlockPool(cfg, KVShape(num_layers=3, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16), device="cpu")
    gen = torch.Generator().manual_seed(0)
    pool.host_units.copy_(_random_bits(tuple(pool.host_units.shape), torch.bfloat16, gen))
    blocks = pool.alloc(5)
    g = HostGather(pool.host_units, pool.cache.cache_buf, max_rows=pool.cache.capacity)
    for step in range(6):
        units = pool.unit_ids(blocks)[torch.randperm(30, generator=gen)[:9]]
        plan = pool.acquire(units)
        g.run(plan.load_units, plan.load_slots)
        assert torch.equal(_bits(pool.cache.cache_buf[plan.slots]), _bits(pool.host_units[units])), step


def test_staging_path_forced_on_cpu_matches_reference():
    gen = torch.Generator().manual_seed(5)
    src = _random_bits((30, 64), torch.float16, gen)
    dst = torch.zeros((12, 64), dtype=torch.float16)
    g = HostGather(src, dst, max_rows=12, path="torch_staging")
    s, d = _ids(30, 12, 9, gen, pad=3)
    g.run(s, d)
    want = torch.zeros_like(dst)
    gather_units_reference(src, s, want, d)
    assert torch.equal(_bits(dst), _bits(want))


def test_gather_validation():
    a = torch.zeros((4, 8), dtype=torch.float16)
    with pytest.raises(ValueError, match="one dtype"):
        HostGather(a, torch.zeros((4, 8), dtype=torch.bfloat16), max_rows=1)
    with pytest.raises(ValueError, match="max_rows"):
        HostGather(a, a.clone(), max_rows=0)
    with pytest.raises(ValueError, match="path="):
        HostGather(a, a.clone(), max_rows=1, path="memcpy")
    with pytest.raises(RuntimeError, match="triton_uva.*probe"):
        HostGather(a, a.clone(), max_rows=1, path="triton_uva")
    g = HostGather(a, a.clone(), max_rows=2)
    with pytest.raises(ValueError, match="max_rows=2"):
        g.run(torch.zeros(3, dtype=torch.int32), torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="contiguous"):
        word_view(torch.zeros((4, 8))[:, :4])
    with pytest.raises(ValueError, match=r"chunk_words=100 .*power of two in \[64, 16384\]"):
        HostGather(a, a.clone(), max_rows=1, chunk_words=100)
    with pytest.raises(ValueError, match="num_warps=3"):
        HostGather(a, a.clone(), max_rows=1, num_warps=3)


@pytest.mark.parametrize("chunk_words,num_warps", [(64, 1), (128, 2), (4096, 8)])
def test_gather_launch_shapes_bit_identical(chunk_words, num_warps):
    gen = torch.Generator().manual_seed(chunk_words)
    src = _random_bits((9, 2 * 8 * 40), torch.bfloat16, gen)  # 320 words: 5 / 3 / 1 chunks
    dst = torch.zeros((6, src.shape[1]), dtype=torch.bfloat16)
    g = HostGather(src, dst, max_rows=6, chunk_words=chunk_words, num_warps=num_warps)
    s, d = _ids(9, 6, 6, gen)
    g.run(s, d)
    want = torch.zeros_like(dst)
    gather_units_reference(src, s, want, d)
    assert torch.equal(_bits(dst), _bits(want))


@pytest.mark.parametrize("threads,n", [(1, 5), (3, 17), (4, 2)])
def test_cpu_assisted_save_bit_identical(threads, n):
    gen = torch.Generator().manual_seed(threads * 10 + n)
    host = _random_bits((40, 2 * 4 * 8), torch.bfloat16, gen)
    want = host.clone()
    cache = _random_bits((20, 2 * 4 * 8), torch.bfloat16, gen)
    saver = HostSave(host, max_rows=20, num_threads=threads)
    try:
        units = torch.randperm(40, generator=gen)[:n]
        slots = torch.randperm(20, generator=gen)[:n]
        fut = saver.save_slots(cache, slots, units)
        assert fut.result() == n
        save_units_reference(cache[slots], want, units)
        assert torch.equal(_bits(host), _bits(want))
        rows = _random_bits((n, 64), torch.bfloat16, gen)  # contiguous rows (e.g. new KV of a step)
        saver.save(rows, units)
        saver.wait()
        save_units_reference(rows, want, units)
        assert torch.equal(_bits(host), _bits(want))
        with pytest.raises(ValueError, match="max_rows=20"):
            saver.save(torch.zeros((21, 64), dtype=torch.bfloat16), torch.arange(21))
        with pytest.raises(ValueError, match="do not match"):
            saver.save(torch.zeros((2, 64), dtype=torch.float16), torch.arange(2))
    finally:
        saver.close()


# ---------------------------------------------------------------- GPU (UVA from pinned memory)

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv_heads", [1, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("page", [16, 32, 64])
def test_gpu_uva_gather_bit_identical(page, head_dim, kv_heads, dtype):
    shape = KVShape(num_layers=2, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    unit_bytes = 2 * page * head_dim * 2
    cfg = HostTierConfig(host_tier_gb=40 * 2 * kv_heads * unit_bytes / (1 << 30), gpu_cache_blocks=301,
                         page_size=page)
    pool = HostBlockPool(cfg, shape)
    assert pool.pinned and pool.cache.cache_buf.is_cuda
    gen = torch.Generator().manual_seed(page + head_dim + kv_heads)
    pool.host_units.copy_(_random_bits(tuple(pool.host_units.shape), dtype, gen))
    pool.alloc(pool.num_blocks)
    g = HostGather(pool.host_units, pool.cache.cache_buf, max_rows=pool.cache.capacity)
    assert g.path in ("triton_uva", "triton_uva_ptr", "torch_staging"), g.path
    n_units = pool.num_units
    for n in (1, 37, min(301, n_units)):  # odd counts, up to the whole cache
        units = torch.randperm(n_units, generator=gen)[:n]
        plan = pool.acquire(units)
        g.run(plan.load_units.cuda(), plan.load_slots.cuda())
        g.wait()
        got = pool.cache.cache_buf[plan.slots.cuda()].cpu()
        assert torch.equal(_bits(got), _bits(pool.host_units[units])), (n, g.path)


@pytest.mark.gpu
def test_gpu_gather_takes_the_fused_uva_path():
    """The fused UVA launch is the point of FlashH2D: the torch staging fallback must not be chosen."""
    host = torch.empty((64, 2 * 16 * 128), dtype=torch.bfloat16, pin_memory=True)
    host.view(torch.int16).copy_(torch.randint(-32768, 32767, host.shape, dtype=torch.int16))
    dst = torch.zeros((32, host.shape[1]), dtype=torch.bfloat16, device="cuda")
    g = HostGather(host, dst, max_rows=32)
    assert g.path in ("triton_uva", "triton_uva_ptr"), (g.path, g.probe_errors)
    s = torch.tensor(list(range(63, 0, -2)), dtype=torch.int32, device="cuda")
    d = torch.arange(32, dtype=torch.int32, device="cuda")
    d[5] = -1  # padding is skipped
    g.run(s, d)
    g.wait()
    want = torch.zeros_like(dst)
    gather_units_reference(host.cuda(), s.cpu(), want, d.cpu())
    torch.cuda.synchronize()
    assert torch.equal(_bits(dst), _bits(want))


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 129, 1000])
def test_gpu_cpu_assisted_save_bit_identical(n):
    gen = torch.Generator().manual_seed(n)
    host = _random_bits((2048, 2 * 16 * 128), torch.bfloat16, gen).pin_memory()
    want = host.clone()
    cache = _random_bits((1024, host.shape[1]), torch.bfloat16, gen, device="cuda")
    saver = HostSave(host, max_rows=1024, device="cuda", num_threads=4)
    try:
        units = torch.randperm(2048, generator=gen)[:n]
        slots = torch.randperm(1024, generator=gen)[:n].cuda()
        saver.save_slots(cache, slots, units).result()
        save_units_reference(cache[slots].cpu(), want, units)
        assert torch.equal(_bits(host), _bits(want))
    finally:
        saver.close()


# ---------------------------------------------------------------- the tier end to end (pool + cache + IO)

def _tier_steps(pool: HostBlockPool, io, steps: int, seed: int, device) -> int:
    """Random decode steps: select units, acquire, run the IO, write new KV into some selected
    units' cache rows (dirty). ``truth[u]`` is the latest content of unit u; after every step each
    cached unit's cache row and each other unit's host row must equal it, bit for bit."""
    rng = torch.Generator().manual_seed(seed)
    dtype = pool.host_units.dtype
    truth = pool.host_units.clone()
    live = pool.unit_ids(pool.alloc(pool.num_blocks))
    cap = pool.cache.capacity
    saves = 0
    for step in range(steps):
        k = int(torch.randint(1, cap + 1, (1,), generator=rng))
        units = live[torch.randperm(live.numel(), generator=rng)[:k]]
        plan = pool.acquire(units)
        io.run(plan.load_units, plan.load_slots, plan.save_slots, plan.save_units)
        io.wait()
        saves += plan.save_slots.numel()
        w = units[torch.randperm(units.numel(), generator=rng)[:max(1, k // 3)]]
        rows = _random_bits((w.numel(), pool.unit_elems), dtype, rng)
        slots = pool.cache.lookup(w)
        pool.cache.cache_buf[slots.to(device)] = rows.to(device)
        pool.cache.mark_dirty(w)
        truth[w] = rows
        io.flush()
        if device != "cpu":
            torch.cuda.synchronize()
        cached = torch.nonzero(pool.cache.slot_of_unit_host >= 0).flatten()
        assert torch.equal(_bits(pool.cache.cache_buf[pool.cache.slot_of_unit_host[cached].to(device)].cpu()),
                           _bits(truth[cached])), step
        dirty_units = pool.cache.unit_of_slot_host[torch.nonzero(pool.cache.dirty_host).flatten()]
        clean = torch.ones(pool.num_units, dtype=torch.bool)
        clean[dirty_units] = False
        assert torch.equal(_bits(pool.host_units[clean]), _bits(truth[clean])), step
    return saves


@pytest.mark.parametrize("seed", [0, 1])
def test_tier_io_end_to_end_interpreter(seed):
    from flashinfer_ext.host_tier.host_transfer import HostTierIO

    shape = KVShape(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
    cfg = HostTierConfig(host_tier_gb=6 * 2 * 2 * (2 * 4 * 8 * 2) / (1 << 30), gpu_cache_blocks=7, page_size=4)
    pool = HostBlockPool(cfg, shape, device="cpu")
    gen = torch.Generator().manual_seed(seed)
    pool.host_units.copy_(_random_bits(tuple(pool.host_units.shape), torch.bfloat16, gen))
    io = HostTierIO(pool.host_units, pool.cache.cache_buf, max_rows=7, num_threads=2)
    try:
        saves = _tier_steps(pool, io, steps=60, seed=seed, device="cpu")
    finally:
        io.close()
    assert saves > 0 and pool.stats().saved_units == saves and pool.stats().evictions > 0


@pytest.mark.gpu
@pytest.mark.parametrize("page", [16, 64])
def test_gpu_tier_io_end_to_end(page):
    from flashinfer_ext.host_tier.host_transfer import HostTierIO

    shape = KVShape(num_layers=4, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    unit_bytes = 2 * page * 128 * 2
    cfg = HostTierConfig(host_tier_gb=24 * 4 * 8 * unit_bytes / (1 << 30), gpu_cache_blocks=257, page_size=page)
    pool = HostBlockPool(cfg, shape)
    gen = torch.Generator().manual_seed(page)
    pool.host_units.copy_(_random_bits(tuple(pool.host_units.shape), torch.bfloat16, gen))
    io = HostTierIO(pool.host_units, pool.cache.cache_buf, max_rows=257)
    try:
        saves = _tier_steps(pool, io, steps=40, seed=page, device="cuda")
    finally:
        io.close()
    assert saves > 0 and io.gather.path in ("triton_uva", "triton_uva_ptr", "torch_staging")
