"""Contract: the one-launch split search of vs_select (Triton) equals its torch reference for both list orders:
the same line counts, costs and covered lower bounds, over several head counts, list lengths spanning several
scan chunks, forced-line counts and targets (reachable, at the edge, unreachable); vs_select gives the same
selection through either."""

from __future__ import annotations

import pytest
import torch

from flashinfer_ext.loopserve.vs_estimate import VSLineSums
from flashinfer_ext.loopserve.vs_select import VSSelectConfig, vs_select
from flashinfer_ext.loopserve.vs_split_search import split_candidates, split_search, split_search_reference


def _lists(hk, n, seed, device="cpu"):
    """Density-sorted (w, m, l) planes of a slash and a vertical list: [3, 2, hk, n] fp32."""
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(2, hk, n, generator=g) ** 6
    m = w * torch.rand(2, hk, n, generator=g)
    lens = (n - torch.arange(n)).float().expand(2, hk, n)
    order = torch.sort(w / lens, dim=2, descending=True).indices
    planes = torch.stack([w, m, lens]).gather(3, order.expand(3, 2, hk, n))
    return planes.contiguous().to(device)


@pytest.mark.parametrize("hk,n,forced,alpha", [
    (1, 50, (4, 2), 0.9),
    (3, 1500, (64, 4), 0.955),     # several 256-entry scan chunks
    (8, 700, (0, 0), 0.5),
    (2, 300, (300, 1), 0.99),      # every slash forced
    (2, 400, (16, 8), 1.5),        # unreachable target: every cost inf, cov = everything
])
def test_split_search_kernel_equals_the_torch_reference(hk, n, forced, alpha):
    lists = _lists(hk, n, seed=hk * 7 + n)
    total = lists[0, 1].sum(1)  # the verticals' mass, as vs_select's target
    target = alpha * total
    cand = split_candidates(n, forced, 16)
    got = split_search(lists, target, cand, forced, block=256)
    ref = split_search_reference(lists, target, cand, forced)
    names = ("cost", "n_s", "n_v", "cov")
    for name, a, b in zip(names, got, ref):
        assert a.shape == (hk, 32), name
        if name in ("n_s", "n_v"):
            assert torch.equal(a, b), name
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
    if alpha > 1:
        assert bool(torch.isinf(got[0]).all())


def test_split_candidates_start_at_the_forced_lines_and_end_at_n():
    cand = split_candidates(1000, (64, 4), 16)
    assert cand.shape == (2, 16) and cand.dtype == torch.int64
    assert cand[:, 0].tolist() == [64, 4] and cand[:, -1].tolist() == [1000, 1000]
    assert bool((cand[:, 1:] >= cand[:, :-1]).all())


@pytest.mark.parametrize("prefix_len", [0, 230])
def test_vs_select_gives_the_same_selection_with_the_kernel_and_the_reference(prefix_len):
    g = torch.Generator().manual_seed(3)
    n, hk = 600, 3
    w = torch.rand(4, hk, n, generator=g) ** 8
    lines = VSLineSums(w[0], w[0] / 3, w[2], w[2] / 3, group_size=3, num_rows=64)
    cfg = VSSelectConfig(alpha=0.955, sink_tokens=4, local_window=64)
    a = vs_select(lines, prefix_len=prefix_len, config=cfg, use_kernel=True)
    b = vs_select(lines, prefix_len=prefix_len, config=cfg, use_kernel=False)
    for x, y in ((a.v_idx, b.v_idx), (a.v_cnt, b.v_cnt), (a.s_idx, b.s_idx), (a.s_cnt, b.s_cnt)):
        assert torch.equal(x, y)
    torch.testing.assert_close(a.covered_lb, b.covered_lb, rtol=1e-5, atol=1e-6)
    assert bool((a.covered_lb >= 0.955 - 1e-4).all())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("hk,n", [(8, 32768), (3, 8192)])
def test_gpu_split_search_equals_the_reference(hk, n):
    lists = _lists(hk, n, seed=5, device="cuda")
    target = 0.955 * lists[0, 1].sum(1)
    cand = split_candidates(n, (64, 4), 16).cuda()
    got = split_search(lists, target, cand, (64, 4))
    ref = split_search_reference(lists, target, cand, (64, 4))
    # scans in another association: a count may move by one where lb_cov meets the target within rounding
    same = (got[1] == ref[1]) & (got[2] == ref[2])
    assert int((got[1] - ref[1]).abs().max()) <= 1 and int((got[2] - ref[2]).abs().max()) <= 1
    assert float(same.float().mean()) >= 0.95
    for a, b in ((got[0], ref[0]), (got[3], ref[3])):
        torch.testing.assert_close(a[same], b[same], rtol=1e-4, atol=1e-3)
