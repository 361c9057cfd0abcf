"""Contract (CPU): `--sparse psa` serves through the stock server — below `min_context` its greedy
output equals `--sparse off`; above it decode is sparse (blocks read < blocks a dense decode reads,
counted by the scheduler process) and the answer still retrieves a fact planted in real text."""

from __future__ import annotations

import pytest
import requests
from pydoc_data.topics import topics

from tests.serverproc import start_cpu_server
from tests.test_server_e2e import PROMPT

pytestmark = pytest.mark.server

MIN_CONTEXT = 256


@pytest.fixture(scope="module")
def psa_server(default_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("psa") / "server.log"
    handle = start_cpu_server(default_model, log, mode="psa",
                              sparse_config=f'{{"min_context": {MIN_CONTEXT}, "epsilon": 0.95}}',
                              extra_args=("--enable-metrics",))
    try:
        yield handle
    finally:
        handle.stop()


def _chat(server, content, max_tokens):
    r = requests.post(server.url + "/v1/chat/completions", timeout=300, json={
        "model": "default", "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens, "temperature": 0})
    r.raise_for_status()
    return r.json()


def _stats(server):
    return requests.get(server.url + "/server_info", timeout=30).json()["internal_states"][0]["sparse"]


def test_psa_below_min_context_equals_dense(psa_server, cpu_server):
    state = _stats(psa_server)
    assert state["mode"] == "psa" and state["attention_backend"] == "PsaTorchNativeAttnBackend"
    before = state["stats"]
    sparse = _chat(psa_server, PROMPT[0]["content"], 24)
    dense = _chat(cpu_server, PROMPT[0]["content"], 24)
    assert sparse["usage"]["prompt_tokens"] < MIN_CONTEXT
    assert sparse["choices"][0]["message"]["content"] == dense["choices"][0]["message"]["content"]
    after = _stats(psa_server)["stats"]
    assert after["sparse_decode_steps"] == before["sparse_decode_steps"]
    assert after["dense_decode_steps"] > before["dense_decode_steps"]


def test_psa_above_min_context_reads_fewer_blocks_and_still_retrieves_the_fact(psa_server):
    text = topics["assignment"][:2600]
    content = (f"Read this text.\n\n{text[:1300]}\n\nThe secret number is 4817.\n\n{text[1300:]}\n\n"
               "What is the secret number? Answer with the number only.")
    before = _stats(psa_server)["stats"]
    r = _chat(psa_server, content, 16)
    after = _stats(psa_server)["stats"]
    assert r["usage"]["prompt_tokens"] > MIN_CONTEXT
    assert "4817" in r["choices"][0]["message"]["content"]
    steps = after["sparse_decode_steps"] - before["sparse_decode_steps"]
    read = after["blocks_read"] - before["blocks_read"]
    total = after["blocks_total"] - before["blocks_total"]
    assert steps >= r["usage"]["completion_tokens"] - 1 > 0
    assert 0 < read < total, (read, total)
    metrics = requests.get(psa_server.url + "/metrics", timeout=30).text
    exported = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
                if line.startswith("sglang_sparse:psa_blocks_")}
    assert exported["sglang_sparse:psa_blocks_read_total"] == after["blocks_read"]
    assert exported["sglang_sparse:psa_blocks_dense_total"] == after["blocks_total"]
