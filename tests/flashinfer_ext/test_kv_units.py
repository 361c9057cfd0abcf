"""kv_units: SGLang token-major pages <-> host-tier units, and a radix-node-sized round trip through
the host tier (pack -> CPU-assisted save -> fused gather -> unpack) that restores the pages bit-exactly."""

from __future__ import annotations

import pytest
import torch

from flashinfer_ext.host_tier.host_transfer import HostGather, HostSave
from flashinfer_ext.host_tier.kv_units import pack_pages, pack_pages_reference, unpack_units
from radix_sparse.host_pool import HostBlockPool, HostTierConfig, KVShape


def _pool_bufs(layers, pages, page, heads, dim, dtype, gen, device="cpu"):
    def one():
        bits = torch.randint(-32768, 32767, (pages * page, heads, dim), dtype=torch.int16, generator=gen)
        return bits.view(dtype).to(device)
    return [one() for _ in range(layers)], [one() for _ in range(layers)]


@pytest.mark.parametrize("page,heads,dim", [(4, 1, 8), (16, 3, 16), (2, 8, 4)])
def test_pack_matches_reference_and_unpack_inverts(page, heads, dim):
    gen = torch.Generator().manual_seed(page + heads + dim)
    k, v = _pool_bufs(3, 10, page, heads, dim, torch.bfloat16, gen)
    pages = torch.tensor([7, 2, 9, 0], dtype=torch.int64)
    out = torch.empty((3 * 4 * heads, 2 * page * dim), dtype=torch.bfloat16)
    pack_pages(k, v, pages, page, out)
    assert torch.equal(out.view(torch.int16), pack_pages_reference(k, v, pages, page).view(torch.int16))
    k2 = [torch.zeros_like(t) for t in k]
    v2 = [torch.zeros_like(t) for t in v]
    unpack_units(out, k2, v2, pages, page)
    for a, b in zip(k + v, k2 + v2):
        pa, pb = a.view(10, page, heads, dim), b.view(10, page, heads, dim)
        assert torch.equal(pa[pages].view(torch.int16), pb[pages].view(torch.int16))
        others = torch.tensor([p for p in range(10) if p not in pages.tolist()])
        assert not pb[others].view(torch.int16).any()  # other pages untouched


def test_shape_checks():
    k = [torch.zeros(8, 2, 4)]
    with pytest.raises(ValueError, match="rows must be"):
        pack_pages(k, k, torch.tensor([0]), 4, torch.zeros(3, 32))
    with pytest.raises(ValueError, match="multiple of page_size=3"):
        pack_pages(k, k, torch.tensor([0]), 3, torch.zeros(2, 24))
    with pytest.raises(ValueError, match="int64"):
        pack_pages(k, k, torch.tensor([0], dtype=torch.int32), 4, torch.zeros(2, 32))


def _node_round_trip(device):
    """A 'radix node' of 5 pages of a 2-layer, 8-head pool evicted to the host and loaded back into
    5 other pages: every layer's K/V of the new pages equals the original pages bit for bit."""
    page, heads, dim, layers = 16, 8, 64, 2
    gen = torch.Generator().manual_seed(11)
    k, v = _pool_bufs(layers, 12, page, heads, dim, torch.bfloat16, gen, device)
    shape = KVShape(layers, heads, dim, torch.bfloat16)
    unit_bytes = 2 * page * dim * 2
    cfg = HostTierConfig(host_tier_gb=8 * layers * heads * unit_bytes / (1 << 30), gpu_cache_blocks=80,
                         page_size=page)
    pool = HostBlockPool(cfg, shape, device=device)
    src_pages = torch.tensor([3, 4, 5, 9, 1], dtype=torch.int64, device=device)
    blocks = pool.alloc(5)
    units = pool.unit_ids(blocks)
    rows = torch.empty((units.numel(), pool.unit_elems), dtype=torch.bfloat16, device=device)
    pack_pages(k, v, src_pages, page, rows)
    saver = HostSave(pool.host_units, max_rows=units.numel(), device=device, num_threads=2)
    try:
        saver.save(rows, units).result()
    finally:
        saver.close()
    plan = pool.acquire(units)  # load the node's units into the GPU cache (all misses)
    g = HostGather(pool.host_units, pool.cache.cache_buf, max_rows=units.numel())
    g.run(plan.load_units.to(device), plan.load_slots.to(device))
    g.wait()
    back = pool.cache.cache_buf[plan.slots.to(device)]  # rows in unit order
    dst_pages = torch.tensor([0, 2, 6, 7, 11], dtype=torch.int64, device=device)
    unpack_units(back, k, v, dst_pages, page)
    for buf in k + v:
        pv = buf.view(12, page, heads, dim)
        assert torch.equal(pv[dst_pages].view(torch.int16), pv[src_pages].view(torch.int16))
    return g.path


def test_node_round_trip_through_host_tier_cpu():
    assert _node_round_trip("cpu") == "triton"


@pytest.mark.gpu
def test_gpu_node_round_trip_through_host_tier():
    assert _node_round_trip("cuda") in ("triton_uva", "triton_uva_ptr", "torch_staging")
