"""Contract (CPU): `--sparse loopserve` with the default dense prefill and `line_chunks: "last"`, under SGLang's
chunked prefill: only the prompt's last chunk selects lines (candidates counted once, over the whole prompt), the
decode after it runs sparse over those lines, and the answer still retrieves the fact."""

from __future__ import annotations

import pytest

from tests.serverproc import chat, start_cpu_server
from tests.test_psa_server import _long_prompt

pytestmark = pytest.mark.server

LAYERS, KV_HEADS = 30, 3  # SmolLM2-135M


@pytest.fixture(scope="module")
def last_chunk_server(default_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("loopserve_line_chunks") / "server.log"
    handle = start_cpu_server(default_model, log, mode="loopserve",
                              sparse_config='{"min_context": 200, "line_chunks": "last"}',
                              extra_args=("--chunked-prefill-size", "256"))
    try:
        yield handle
    finally:
        handle.stop()


def test_last_chunk_lines_only_then_sparse_decode_retrieves_the_fact(last_chunk_server):
    # a budget below the prompt length, so that the decode lists are narrower than the context
    r = chat(last_chunk_server, "Last chunk. " + _long_prompt(), 12, custom_params={"sparse": {"budget": 64}})
    n = r["usage"]["prompt_tokens"]
    assert n > 2 * 256
    assert "4817" in r["choices"][0]["message"]["content"]
    rep = r["metadata"]["sparse"]
    # one selection per layer, at the last chunk, over all n keys (all chunks would count 256 + 512 + ... + n)
    assert rep["lines_total"] == 2 * LAYERS * KV_HEADS * n
    assert rep["vertical_lines"] > 0 and 0 < rep["line_fraction"] < 1.0
    n_out = r["usage"]["completion_tokens"]
    assert rep["sparse_decode_steps"] == n_out - 1
    assert 0 < rep["decode_tokens_read"] < rep["decode_tokens_total"]
