"""Contract: the LoopServe phase probe's causal score matrix masks exactly the future keys and shares each KV
head across its query-head group (what its coverage figures in loopserve_root_cause.md are computed from)."""

from __future__ import annotations

import torch


def test_causal_probs_masks_future_keys_per_query_group():
    from bench.loopserve_probe import causal_probs

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(6, 3, 8, generator=g), torch.randn(2, 5, 8, generator=g)   # 6 query heads, 2 KV heads
    qpos = torch.tensor([1, 2, 4])
    s = causal_probs(q, k, qpos, 0.5)
    assert s.shape == (6, 3, 5)
    for h in range(6):
        for t, p in enumerate(qpos.tolist()):
            want = (q[h, t] @ k[h // 3].T) * 0.5
            torch.testing.assert_close(s[h, t, : p + 1], want[: p + 1])
            assert torch.isinf(s[h, t, p + 1:]).all()
