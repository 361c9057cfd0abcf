"""Contract (CPU): `--sparse loopserve` with SGLang's chunked prefill and `prefill: "lines"` — every chunk of a
long prompt selects lines over all earlier keys of the request (prefix included) and runs sparse over the lines
of all its chunks so far; the request's report adds the chunks up (one cumulative prefill row), and the answer
still retrieves the fact."""

from __future__ import annotations

import pytest
import requests

from tests.serverproc import start_cpu_server
from tests.test_psa_server import _long_prompt

pytestmark = pytest.mark.server

LAYERS, KV_HEADS = 30, 3  # SmolLM2-135M


@pytest.fixture(scope="module")
def chunked_server(default_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("loopserve_chunked") / "server.log"
    handle = start_cpu_server(default_model, log, mode="loopserve",
                              sparse_config='{"min_context": 200, "alpha": 0.99, "prefill": "lines"}',
                              extra_args=("--chunked-prefill-size", "256"))
    try:
        yield handle
    finally:
        handle.stop()


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
