"""Contract (CPU): `--sparse lastwindow` (the LoopServe question-position baseline) serves through the
stock server: prefill stays dense; below `min_context` the greedy output equals `--sparse off`; above
it every decode step attends only the top-`budget` tokens per KV head chosen once from the attention
of the prompt's last `window` queries, plus the sink, that window and the generated tokens (reported
per request as `mode: lastwindow`, fewer tokens read than dense, no re-selection)."""

from __future__ import annotations

import pytest
import requests

from tests.serverproc import chat, start_cpu_server
from tests.test_psa_server import _long_prompt
from tests.test_server_e2e import PROMPT

pytestmark = pytest.mark.server

MIN_CONTEXT = 256
BUDGET = 48


@pytest.fixture(scope="module")
def lw_server(default_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("lastwindow") / "server.log"
    handle = start_cpu_server(default_model, log, mode="lastwindow",
                              sparse_config=f'{{"min_context": {MIN_CONTEXT}, "budget": {BUDGET}}}')
    try:
        yield handle, log
    finally:
        handle.stop()


def test_lastwindow_short_prompt_equals_dense(lw_server, cpu_server):
    server, _ = lw_server
    state = requests.get(server.url + "/server_info", timeout=30).json()["internal_states"][0]["sparse"]
    assert state["mode"] == "lastwindow" and state["attention_backend"] == "LastWindowTorchNativeAttnBackend"
    assert state["config"] == {"budget": BUDGET, "window": 32, "min_context": MIN_CONTEXT, "sink_tokens": 4,
                               "pool_kernel": 7, "graph_list_width": 2048,
                               "graph_max_bs": 16, "stock_graphs": True, "prefill_graphs": True, "runner": "auto"}
    short = chat(server, PROMPT[0]["content"], 24)
    assert short["usage"]["prompt_tokens"] < MIN_CONTEXT
    assert short["choices"][0]["message"]["content"] == chat(cpu_server, PROMPT[0]["content"], 24)[
        "choices"][0]["message"]["content"]
    assert short["metadata"]["sparse"]["sparse_decode_steps"] == 0


def test_lastwindow_decodes_over_the_fixed_budget_above_min_context(lw_server, cpu_server):
    server, log = lw_server
    content = "Last window. " + _long_prompt()
    r = chat(server, content, 20, ignore_eos=True)
    n_prompt, n_out = r["usage"]["prompt_tokens"], r["usage"]["completion_tokens"]
    assert n_prompt > MIN_CONTEXT and n_out == 20
    rep = r["metadata"]["sparse"]
    assert rep["mode"] == "lastwindow" and rep["sparse_prefill"] is False and rep["reselections"] == 0
    assert rep["sparse_decode_steps"] == n_out - 1
    # per decode step and (layer, KV head): <= budget + sink + window + generated tokens, of the whole context
    assert 0 < rep["decode_tokens_read"] < rep["decode_tokens_total"]
    assert rep["decode_read_fraction"] <= (BUDGET + 4 + 32 + n_out) / n_prompt
    dense = chat(cpu_server, content, 20, ignore_eos=True)
    assert dense["usage"]["prompt_tokens"] == n_prompt
    text = log.read_text(errors="replace").lower()
    assert "traceback" not in text and "leak" not in text


def test_lastwindow_takes_no_per_request_options(lw_server):
    server, _ = lw_server
    r = requests.post(server.url + "/v1/chat/completions", timeout=120, json={
        "model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
        "custom_params": {"sparse": {"budget": 8}}})
    assert r.status_code == 400, r.text
    assert "takes no per-request options" in r.text
