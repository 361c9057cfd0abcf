"""CUDA-graph contract shared by the PSA wrapper tests: a graph captured over ``w.run`` replays as eager after
``plan()``, and replays again after a decode step's plan and metadata fold (no sglang import)."""

from __future__ import annotations

import torch


def assert_graph_replay_matches_eager(w, pool, meta, table) -> None:
    """``w``: a planned :class:`flashinfer_ext.psa.decode.PsaDecodeWrapper` over ``pool`` (a ``kv_pool.Pool`` on
    CUDA, blocks of 16); ``meta``: its layer's metadata or sketch; ``table``: the block table it was planned with."""
    o0, lse0, n0 = (t.clone() for t in w.run(pool.q, pool.k_buffer, pool.v_buffer, *meta))
    w.plan(pool.req_to_token, pool.req_pool_indices, pool.seq_lens, table)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        w.run(pool.q, pool.k_buffer, pool.v_buffer, *meta)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        o, lse, n = w.run(pool.q, pool.k_buffer, pool.v_buffer, *meta)
    w.plan(pool.req_to_token, pool.req_pool_indices, pool.seq_lens, table)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(n, n0)
    torch.testing.assert_close(o, o0, rtol=0, atol=0)
    torch.testing.assert_close(lse, lse0, rtol=0, atol=0)
    # the decode fold replays too: one more token per request, then the graph again
    pool.seq_lens += 1
    w.plan(pool.req_to_token, pool.req_pool_indices, pool.seq_lens, table)
    w.update_meta_decode(pool.k_buffer, *meta)
    g.replay()
    torch.cuda.synchronize()
    assert bool((n <= (pool.seq_lens[:, None] + 15) // 16).all())
