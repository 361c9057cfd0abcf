"""Contract (host tier, #6): the PSA CUDA runner's load listener ``rebuild_page_meta`` recomputes the block
metadata of reloaded pages from their keys: min/max equal to the incremental kernel's bit for bit, the mean
within one rounding of the pool dtype (the kernel averages incrementally in fp32). CPU: Triton interpreter."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from flashinfer_ext.psa.block_meta import BlockMetaPool, paged_block_table
from sglang_sparse.psa.cuda_runner import PsaCudaRunner

from .kv_pool import make_pool


@pytest.mark.parametrize("page,dtype", [(16, torch.bfloat16), (32, torch.float16)])
def test_rebuilt_page_meta_equals_incremental_kernel(page, dtype):
    seq_lens = [4 * page, 2 * page]  # whole pages, as a reloaded radix node has
    layers, heads, dim = 2, 3, 64
    pool = make_pool(seq_lens, heads, heads, dim, dtype, page, seed=3)
    k_bufs = [pool.k_buffer, torch.flip(pool.k_buffer, dims=[2]).contiguous()]  # two distinct layers
    rows = pool.k_buffer.shape[0] // page + 1
    nb = max(seq_lens) // page
    table = paged_block_table(pool.req_to_token, pool.req_pool_indices, page, nb)
    kernel = BlockMetaPool(layers, rows, heads, dim, page, dtype=dtype)
    zero = torch.zeros(len(seq_lens), dtype=torch.int32)
    for lid in range(layers):
        kernel.update(lid, k_bufs[lid], pool.req_to_token, pool.req_pool_indices, table, zero, pool.seq_lens, nb)
    rebuilt = BlockMetaPool(layers, rows, heads, dim, page, dtype=dtype)
    for t in (rebuilt.kmin, rebuilt.kmax, rebuilt.kmean):
        t.fill_(7.0)  # stale rows of whoever used the pages before
    pages = torch.cat([table[r, : seq_lens[r] // page] for r in range(len(seq_lens))]).long()
    runner = SimpleNamespace(rows=None, block_size=page, shape=SimpleNamespace(num_layers=layers), meta=rebuilt,
                             pool=SimpleNamespace(get_key_buffer=lambda lid: k_bufs[lid]))
    PsaCudaRunner.rebuild_page_meta(runner, pages)
    for lid in range(layers):
        for name in ("kmin", "kmax"):
            assert torch.equal(getattr(rebuilt, name)[lid][pages], getattr(kernel, name)[lid][pages]), name
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(rebuilt.kmean[lid][pages].float(), kernel.kmean[lid][pages].float(),
                                   rtol=2 * eps, atol=2 * eps)
        # a page that was not reloaded keeps its (stale) rows
        other = torch.tensor(sorted(set(range(rows)) - set(pages.tolist()))[:1])
        assert bool((rebuilt.kmin[lid][other] == 7.0).all())
