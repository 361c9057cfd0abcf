"""SamKV selective recompute: the recompute set, Eq. 4, and (CPU server, real SmolLM2-135M) the recompute
forward itself: with every kept token recomputed (``recompute_ratio`` 1, ``overwrite``) the assembled
composite must be the dense prefill of the concatenation, so the ``cacheblend`` variant's greedy answer and
first-token log-probabilities equal the ``recompute`` (dense) baseline's; with plain ``reuse`` they differ
(negative control: documents prefilled alone lack cross-document attention)."""

from __future__ import annotations

import pytest
import torch

from bench.samkv_bench import make_task
from sglang_sparse.samkv.recompute import fuse_kv, recompute_set
from tests.serverproc import ask_documents_first_token, start_cpu_server


def test_recompute_set_takes_top_scores_per_document_within_limit():
    kept = [[0, 1, 2, 3], [0, 2, 4]]
    scores = [torch.tensor([0.1, 0.9, 0.5, 0.2]), torch.tensor([5.0, 0.0, 1.0, 0.0, 3.0])]
    assert recompute_set(kept, scores, 0.5, limit=100) == [1, 2, 4, 6]  # doc 1's top 2: pos 0 (4), pos 4 (6)
    assert recompute_set(kept, scores, 0.5, limit=5) == [1, 2, 4]
    assert recompute_set(kept, scores, 0.0, limit=100) == []


def test_fuse_kv_is_eq4():
    g = torch.Generator().manual_seed(0)
    new, old = torch.randn(3, 2, 8, generator=g), torch.randn(3, 2, 8, generator=g)
    assert torch.equal(fuse_kv(new, old, "overwrite"), new)
    near = old + 0.3 * new  # cos(near, old) > 0
    got = fuse_kv(near, old, "fusion")
    th = float((near * old).sum() / (near.norm() * old.norm()))  # one theta for the whole tensor
    assert 0 < th < 1
    torch.testing.assert_close(got, th * near + (1 - th) * old)
    assert torch.equal(fuse_kv(-old, old, "fusion"), old)  # cos < 0 clamps to 0: the old state stays
    assert torch.allclose(fuse_kv(old, old, "fusion"), old, atol=1e-6)  # theta = 1 keeps old == new


@pytest.mark.server
def test_full_recompute_through_the_server_equals_dense(default_model, tmp_path):
    server = start_cpu_server(default_model, tmp_path / "server.log", mode="samkv",
                              sparse_config='{"block_size": 16, "recompute_ratio": 1.0, "fuse": "overwrite", '
                                            '"side_graphs": "off"}')
    try:
        diffs, reuse_diffs = [], []
        for seed in (4, 5):
            task = make_task(seed, docs=3, words=90)

            def ask(variant):
                return ask_documents_first_token(server.url, task, variant)

            ask("reuse")  # documents cached
            dense_text, dense_lp, _ = ask("recompute")
            blend_text, blend_lp, meta = ask("cacheblend")
            reuse_text, reuse_lp, _ = ask("reuse")
            # every document token recomputed; the cached context is the documents plus the template prefix
            assert meta["assembled"] and meta["recomputed_tokens"] == meta["document_tokens"]
            assert meta["cached_tokens"] == meta["document_tokens"] + meta["prefix_tokens"]
            # the eager path at the request's own shapes (the padded one equals it: tests/test_samkv_graph.py)
            assert meta["side_forward"] == {"selection": "eager", "recompute": "eager"}, meta["side_forward"]
            # the same first token; fp32 side attention vs the bf16 backend can split near-ties later in the text
            assert max(blend_lp, key=blend_lp.get) == max(dense_lp, key=dense_lp.get)
            diff = max(abs(blend_lp[t] - dense_lp[t]) for t in dense_lp if t in blend_lp)
            assert diff < 0.25, (diff, blend_lp, dense_lp)  # bf16 pool + fp32 side attention vs the bf16 backend
            diffs.append(diff)
            reuse_diffs.append(max(abs(reuse_lp[t] - dense_lp[t]) for t in dense_lp if t in reuse_lp))
        print(f"max |dlogprob| of the top-5 first tokens vs dense: cacheblend(all) {diffs}, reuse {reuse_diffs}")
        # over the tasks, the full recompute is much closer to dense than plain reuse
        assert sum(reuse_diffs) > 2 * sum(diffs), (reuse_diffs, diffs)
        text = (tmp_path / "server.log").read_text(errors="replace").lower()
        assert "traceback" not in text and "leak" not in text
    finally:
        server.stop()


@pytest.mark.parametrize("mode", ["fusion", "overwrite"])
def test_fuse_kv_layers_is_fuse_kv_of_each_layer(mode):
    from sglang_sparse.samkv.recompute import fuse_kv_layers

    g = torch.Generator().manual_seed(5)
    old = torch.randn(4, 7, 3, 16, generator=g).to(torch.bfloat16)
    new = (old.float() + torch.randn(4, 7, 3, 16, generator=g) * torch.tensor([0.1, 1.0, 3.0, -1.0]).view(4, 1, 1, 1))
    got = fuse_kv_layers(new, old, mode)
    assert got.dtype == old.dtype and got.shape == old.shape
    for layer in range(4):
        assert torch.equal(got[layer], fuse_kv(new[layer], old[layer], mode))
