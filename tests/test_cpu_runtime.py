"""Contract: the test-only CPU runtime activates only without CUDA, and its pure-torch paged
allocator hands out the slots SGLang's paged allocator would (page-aligned, no duplicates)."""

from __future__ import annotations

import pytest
import torch

sglang_sparse_cpu_runtime = pytest.importorskip("sglang_sparse_cpu_runtime")


def test_platform_plugin_is_inert_when_cuda_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert sglang_sparse_cpu_runtime.activate() is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert sglang_sparse_cpu_runtime.activate() == sglang_sparse_cpu_runtime.PLATFORM_QUALNAME


def _allocator(num_pages: int, page_size: int):
    from sglang_sparse_cpu_runtime.allocator import TorchPagedTokenToKVPoolAllocator

    return TorchPagedTokenToKVPoolAllocator(num_pages * page_size, page_size, torch.bfloat16, "cpu", None, False)


@pytest.mark.parametrize("page_size", [4, 16])
def test_paged_allocator_extend_then_decode_is_page_aligned_and_unique(page_size):
    alloc = _allocator(64, page_size)
    prefix = torch.tensor([0, 0, 0], dtype=torch.int64)
    seq = torch.tensor([5, page_size, 2 * page_size + 3], dtype=torch.int64)
    last_loc = torch.full((3,), -1, dtype=torch.int64)
    out = alloc.alloc_extend(prefix, prefix, seq, seq, last_loc, int(seq.sum()))
    assert out is not None and out.numel() == int(seq.sum()) and out.unique().numel() == out.numel()
    starts = torch.cumsum(seq, 0) - seq
    locs = [out[s:s + n] for s, n in zip(starts.tolist(), seq.tolist())]
    for loc in locs:  # each request's tokens fill its pages in order
        assert torch.equal(loc % page_size, torch.arange(loc.numel()) % page_size)
    # decode one token each: continue inside the page, or open a fresh page when the last one is full
    new_seq = seq + 1
    dec = alloc.alloc_decode(new_seq, new_seq, torch.stack([loc[-1] for loc in locs]))
    for loc, d, n in zip(locs, dec.tolist(), seq.tolist()):
        if n % page_size == 0:
            assert d % page_size == 0 and d // page_size not in set((loc // page_size).tolist())
        else:
            assert d == int(loc[-1]) + 1
    assert len(set(dec.tolist()) | set(out.tolist())) == out.numel() + dec.numel()


def test_paged_allocator_returns_none_when_out_of_pages():
    alloc = _allocator(2, 16)
    z = torch.zeros(1, dtype=torch.int64)
    seq = torch.tensor([40], dtype=torch.int64)
    assert alloc.alloc_extend(z, z, seq, seq, torch.tensor([-1]), 40) is None
    assert alloc.available_size() == 32
