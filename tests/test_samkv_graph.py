"""SamKV's padded / CUDA-graph side forwards (sglang_sparse.samkv.graph): buckets, and the padded path equal to
the eager one through the CPU server (fp32, so the comparison is not lost in bf16 rounding)."""

from __future__ import annotations

import pytest

from bench.samkv_bench import make_task
from sglang_sparse.config import SamKVConfig, SparseConfigError
from sglang_sparse.samkv.graph import context_bucket, rows_bucket
from tests.serverproc import ask_documents_first_token, start_cpu_servers


@pytest.mark.parametrize("r,want", [(1, 64), (64, 64), (65, 128), (512, 512), (513, 768), (1000, 1024)])
def test_rows_bucket_pads_to_64_then_256(r, want):
    assert rows_bucket(r) == want


@pytest.mark.parametrize("c,want", [(1, 256), (256, 256), (257, 512), (1024, 1024), (1025, 1536), (2144, 2560),
                                    (4096, 4096)])
def test_context_bucket_pads_to_256_then_512(c, want):
    assert context_bucket(c) == want


def test_side_graphs_config_is_validated():
    assert SamKVConfig().side_graphs == "auto"
    with pytest.raises(SparseConfigError, match="'side_graphs' of mode 'samkv' = 'on' is not allowed"):
        SamKVConfig(side_graphs="on")
    with pytest.raises(SparseConfigError, match="'side_graph_max_rows' of mode 'samkv' = 0 is out of range"):
        SamKVConfig(side_graph_max_rows=0)


@pytest.mark.server
def test_padded_side_forwards_equal_the_eager_ones_through_the_server(default_model, tmp_path):
    """The padded path (rows and context padded to buckets, static buffers: what a CUDA graph replays) gives the
    first token's log-probs of the eager path at the request's own shapes for samkv and cacheblend, the model in
    fp32 (bf16 alone moves them ~0.03: other GEMM shapes)."""
    task = make_task(4, docs=3, words=90)
    out = {}
    modes = ("off", "pad")
    servers = start_cpu_servers(default_model, *(dict(
        log_path=tmp_path / f"{mode}.log", mode="samkv", extra_args=("--dtype", "float32"),
        sparse_config='{"block_size": 16, "recompute_ratio": 0.5, "side_graphs": "%s", '
                      '"side_graph_max_rows": 1024}' % mode) for mode in modes))
    try:
        for mode, server in zip(modes, servers):
            def ask(variant):
                _, lp, meta = ask_documents_first_token(server.url, task, variant, max_tokens=4)
                return lp, meta

            ask("reuse")  # documents cached
            out[mode] = {v: ask(v) for v in ("samkv", "cacheblend")}
    finally:
        for server in servers:
            server.stop()
    for variant in ("samkv", "cacheblend"):
        (eager, meta_e), (padded, meta_p) = out["off"][variant], out["pad"][variant]
        assert meta_e["side_forward"] == {"selection": "eager", "recompute": "eager"}
        assert meta_p["side_forward"] == {"selection": "pad", "recompute": "pad"}, meta_p["side_forward"]
        assert meta_p["recomputed_tokens"] == meta_e["recomputed_tokens"] > 0
        assert eager.keys() == padded.keys()
        diff = max(abs(eager[t] - padded[t]) for t in eager)
        print(f"{variant}: max |first-token logprob| padded vs eager (fp32): {diff:.2e}")
        assert diff < 1e-3, (variant, diff, eager, padded)


def test_side_attention_config_is_validated():
    assert SamKVConfig().side_attention == "model"
    assert SamKVConfig(side_attention="fp32").side_attention == "fp32"
    with pytest.raises(SparseConfigError, match="'side_attention' of mode 'samkv' = 'bf16' is not allowed"):
        SamKVConfig(side_attention="bf16")
