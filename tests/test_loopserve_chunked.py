"""Contract (CPU): `--sparse loopserve` with SGLang's chunked prefill and `prefill: "lines"` — every chunk of a
long prompt selects lines over all earlier keys of the request (prefix included) and runs sparse over the lines
of all its chunks so far; the request's report adds the chunks up (one cumulative prefill row), and the answer
still retrieves the fact. With the default dense prefill and `line_chunks: "last"` only the prompt's last chunk
selects lines (candidates counted once, over the whole prompt) and the decode after it runs sparse over them."""

from __future__ import annotations

import pytest
import requests

from tests.serverproc import chat, start_cpu_server
from tests.test_psa_server import _long_prompt

pytestmark = pytest.mark.server

LAYERS, KV_HEADS = 30, 3  # SmolLM2-135M


def _chunked(default_model, tmp_path_factory, name: str, sparse_config: str):
    """A loopserve CPU server with 256-token prefill chunks (a generator: the fixtures below yield from it)."""
    handle = start_cpu_server(default_model, tmp_path_factory.mktemp(name) / "server.log", mode="loopserve",
                              sparse_config=sparse_config, extra_args=("--chunked-prefill-size", "256"))
    try:
        yield handle
    finally:
        handle.stop()


@pytest.fixture(scope="module")
def chunked_server(default_model, tmp_path_factory):
    yield from _chunked(default_model, tmp_path_factory, "loopserve_chunked",
                        '{"min_context": 200, "alpha": 0.99, "prefill": "lines"}')


@pytest.fixture(scope="module")
def last_chunk_server(default_model, tmp_path_factory):
    yield from _chunked(default_model, tmp_path_factory, "loopserve_line_chunks",
                        '{"min_context": 200, "line_chunks": "last"}')


def test_chunked_prefill_selects_per_chunk_over_all_earlier_keys(chunked_server):
    r = requests.post(chunked_server.url + "/v1/chat/completions", timeout=600, json={
        "model": "default", "messages": [{"role": "user", "content": "Chunked. " + _long_prompt()}],
        "max_tokens": 12, "temperature": 0})
    r.raise_for_status()
    r = r.json()
    n = r["usage"]["prompt_tokens"]
    assert n > 2 * 256
    assert "4817" in r["choices"][0]["message"]["content"]
    rep = r["metadata"]["sparse"]
    assert rep["sparse_prefill"] is True and rep["covered_mass"] >= 0.99 - 1e-4
    # candidates are counted per chunk over its whole context (256, 512, n): more than one chunk's worth
    assert rep["lines_total"] == 2 * LAYERS * KV_HEADS * (256 + 512 + n)
    assert 0 < rep["line_fraction"] < 1.0


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
