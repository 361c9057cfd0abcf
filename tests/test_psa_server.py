"""Contract (CPU): `--sparse psa` serves through the stock server — below `min_context` its greedy
output equals `--sparse off`; above it decode is sparse (blocks read < blocks a dense decode reads,
counted by the scheduler process) and the answer still retrieves a fact planted in real text; a request
whose prompt PSA would read more than `dense_above` of (the prefill probe of the adaptive switch) decodes
densely, and since the probe leaves the prefill stock and the steps before the decision are stock too, its output
equals `--sparse off`'s."""

from __future__ import annotations

import pytest
import requests
from pydoc_data.topics import topics

from tests.serverproc import chat, start_cpu_server
from tests.test_server_e2e import PROMPT

pytestmark = pytest.mark.server

MIN_CONTEXT = 256
DENSE_ABOVE = 0.9  # on this prompt epsilon 0.95 reads ~96 % of the blocks (switches), epsilon 0.5 ~80 % (stays)


@pytest.fixture(scope="module")
def psa_server(default_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("psa") / "server.log"
    handle = start_cpu_server(default_model, log, mode="psa",
                              sparse_config=f'{{"min_context": {MIN_CONTEXT}, "epsilon": 0.95, '
                                            f'"dense_above": {DENSE_ABOVE}, "probe_steps": 2}}',
                              extra_args=("--enable-metrics",))
    try:
        yield handle
    finally:
        handle.stop()


def _long_prompt():
    text = topics["assignment"][:2600]
    return (f"Read this text.\n\n{text[:1300]}\n\nThe secret number is 4817.\n\n{text[1300:]}\n\n"
            "What is the secret number? Answer with the number only.")


def _stats(server):
    return requests.get(server.url + "/server_info", timeout=30).json()["internal_states"][0]["sparse"]


def test_psa_below_min_context_equals_dense(psa_server, cpu_server):
    state = _stats(psa_server)
    assert state["mode"] == "psa" and state["attention_backend"] == "PsaTorchNativeAttnBackend"
    assert state["engagement"] == {"min_context": MIN_CONTEXT, "context_length": 8192, "longest_sequence": 8191,
                                   "reachable": True, "dormant": False}
    before = state["stats"]
    sparse = chat(psa_server, PROMPT[0]["content"], 24)
    dense = chat(cpu_server, PROMPT[0]["content"], 24)
    assert sparse["usage"]["prompt_tokens"] < MIN_CONTEXT
    assert sparse["choices"][0]["message"]["content"] == dense["choices"][0]["message"]["content"]
    after = _stats(psa_server)["stats"]
    assert after["sparse_decode_steps"] == before["sparse_decode_steps"]
    assert after["dense_decode_steps"] > before["dense_decode_steps"]


def test_a_request_the_switch_sends_dense_answers_exactly_as_dense(psa_server, cpu_server):
    """The prefill probe counts what PSA would read for the prompt's last query; the request then decodes densely
    (a stock step or none while the decision is read back): the output equals `--sparse off`'s, token for token."""
    content = _long_prompt()
    before = _stats(psa_server)["stats"]
    r = chat(psa_server, content, 16)
    after = _stats(psa_server)["stats"]
    assert r["usage"]["prompt_tokens"] > MIN_CONTEXT
    assert "4817" in r["choices"][0]["message"]["content"]
    assert r["choices"][0]["message"]["content"] == chat(cpu_server, content, 16)["choices"][0]["message"]["content"]
    read = after["probe_blocks_read"] - before["probe_blocks_read"]
    total = after["probe_blocks_total"] - before["probe_blocks_total"]
    rep = r["metadata"]["sparse"]
    # the adaptive switch: decided by the prefill probe; at most one stock step before the decision arrives
    assert rep["prefill_probe"] and rep["probe_steps"] == 0, rep
    assert rep["sparse_decode_steps"] == 0 and rep["read_fraction"] is None
    assert r["usage"]["completion_tokens"] - 2 <= rep["switched_dense_steps"] <= r["usage"]["completion_tokens"] - 1
    assert rep["probe_read_fraction"] > DENSE_ABOVE
    assert after["switched_dense_rows"] - before["switched_dense_rows"] >= rep["switched_dense_steps"]
    assert after["prefill_probes"] - before["prefill_probes"] == 1
    assert 0 < read < total, (read, total)
    metrics = requests.get(psa_server.url + "/metrics", timeout=30).text
    exported = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
                if line.startswith("sglang_sparse:psa_blocks_")}
    assert exported["sglang_sparse:psa_blocks_read_total"] == after["blocks_read"]
    assert exported["sglang_sparse:psa_blocks_dense_total"] == after["blocks_total"]
    # the per-request report: response metadata, consistent with the server counters
    assert rep["mode"] == "psa" and rep["epsilon"] == 0.95
    # one report row per output token; the first token comes from prefill. The server counters may
    # hold one more step (the overlap scheduler decodes once past a request's last token).
    assert rep["steps"] == r["usage"]["completion_tokens"]
    assert "sglang_sparse:psa_kept_mass_count" in metrics


def test_per_request_epsilon_is_clamped_reported_and_reads_more_when_higher(psa_server):
    content = _long_prompt()
    before = _stats(psa_server)["stats"]
    low = chat(psa_server, content, 6, custom_params={"sparse": {"epsilon": 0.01}})["metadata"]["sparse"]
    after = _stats(psa_server)["stats"]
    high = chat(psa_server, content, 6, custom_params={"sparse": {"epsilon": 0.999}})["metadata"]["sparse"]
    dense = chat(psa_server, content, 6, custom_params={"sparse": {"epsilon": 1.0}})["metadata"]["sparse"]
    assert low["epsilon"] == 0.5  # clamped to the server's min_request_epsilon
    assert high["epsilon"] == 0.999 and high["probe_read_fraction"] >= low["probe_read_fraction"] > 0
    # focused enough: stays sparse after its probe steps, reading fewer blocks than dense
    assert low["switched_dense_steps"] == 0 and low["probe_read_fraction"] <= DENSE_ABOVE
    assert low["sparse_decode_steps"] > 0 and 0 < low["read_fraction"] < 1 and 0.5 < low["kept_mass"] <= 1.0
    read = after["blocks_read"] - before["blocks_read"]
    total = after["blocks_total"] - before["blocks_total"]
    assert 0 < low["blocks_read"] <= read < total and low["blocks_total"] <= total
    assert after["sparse_rows"] - before["sparse_rows"] >= low["sparse_decode_steps"]
    assert high["switched_dense_steps"] > 0 and high["sparse_decode_steps"] == 0  # would read nearly every block
    assert dense["epsilon"] == 1.0 and dense["sparse_decode_steps"] == 0  # epsilon 1: dense decode
    # the same request options through the native /generate door: per-token step rows in meta_info
    g = requests.post(psa_server.url + "/generate", timeout=300, json={
        "text": content, "sampling_params": {"max_new_tokens": 4, "temperature": 0,
                                             "custom_params": {"sparse": {"epsilon": 0.9}}}}).json()
    rows = g["meta_info"]["sparse_psa_steps"]
    assert len(rows) == g["meta_info"]["completion_tokens"] and rows[0][0] == 4  # the prefill probe's row
    assert all(row[0] in (0, 1, 2) for row in rows[1:])
    assert rows[-1][5] == pytest.approx(0.9)  # fp32 step rows


@pytest.mark.parametrize("bad, needle", [
    ({"epsilon": 0}, "custom_params.sparse.epsilon = 0 is out of range"),
    ({"epsilon": 2}, "expected a number in (0, 1]"),
    ({"epsilon": "x"}, "custom_params.sparse.epsilon = 'x'"),
    ({"budget": 3}, "unknown key(s) 'budget'"),
])
def test_bad_per_request_options_get_a_400_and_the_server_keeps_serving(psa_server, bad, needle):
    r = requests.post(psa_server.url + "/v1/chat/completions", timeout=120, json={
        "model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
        "custom_params": {"sparse": bad}})
    assert r.status_code == 400, r.text
    assert needle in r.text
    assert chat(psa_server, "Hi", 2)["choices"][0]["message"]["content"] is not None
