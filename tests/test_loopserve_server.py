"""Contract (CPU): `--sparse loopserve` serves through the stock server.

* below `min_context`, and with alpha = 1.0 at any context, the greedy output equals `--sparse off`;
* above it, prefill selects vertical/slash lines (fewer lines than dense, covered mass >= the selection's
  bound) while the stock attention computes it (`prefill: "dense"`, the default: the first token equals
  `--sparse off`'s; `prefill: "lines"`, the sparse prefill, is tested with chunked prefill in
  test_loopserve_chunked.py), decode attends the lines of all turns + top-B re-selected every n_d
  tokens (Alg. 3), and the answer still retrieves a fact planted in real text;
* a multi-turn `@sgl.function` program: turn 2's radix prefix hit reuses turn 1's lines, read from
  /metrics (`sglang_sparse:loopserve_reused_lines_total`);
* per-request `alpha` / `budget` through `custom_params.sparse` (clamped to the server limits, 400 on
  bad values), reported in the response's `metadata["sparse"]`.
"""

from __future__ import annotations


import json

import pytest
import requests
from pydoc_data.topics import topics

from tests.serverproc import chat, sparse_metrics, sparse_metrics_when, start_cpu_server
from tests.test_psa_server import _long_prompt
from tests.test_server_e2e import PROMPT

pytestmark = pytest.mark.server

MIN_CONTEXT = 256
ALPHA = 0.97


@pytest.fixture(scope="module")
def ls_server(default_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("loopserve") / "server.log"
    handle = start_cpu_server(default_model, log, mode="loopserve",
                              sparse_config=f'{{"min_context": {MIN_CONTEXT}, "alpha": {ALPHA}, "budget": 256, '
                                            '"max_request_budget": 512}',
                              extra_args=("--enable-metrics",))
    try:
        yield handle, log
    finally:
        handle.stop()


def _stats(server):
    return requests.get(server.url + "/server_info", timeout=30).json()["internal_states"][0]["sparse"]


def _metrics(server) -> dict[str, float]:
    return sparse_metrics(server, "sglang_sparse:loopserve_")


def _metrics_when(server, key, pred, timeout_s=30.0):
    return sparse_metrics_when(server, "sglang_sparse:loopserve_", key, pred, timeout_s)


def test_below_min_context_and_alpha_one_equal_dense(ls_server, cpu_server):
    server, _ = ls_server
    state = _stats(server)
    assert state["mode"] == "loopserve" and state["attention_backend"] == "LoopServeTorchNativeAttnBackend"
    short = chat(server, PROMPT[0]["content"], 24)
    assert short["usage"]["prompt_tokens"] < MIN_CONTEXT
    assert short["choices"][0]["message"]["content"] == chat(cpu_server, PROMPT[0]["content"], 24)[
        "choices"][0]["message"]["content"]
    assert short["metadata"]["sparse"]["sparse_prefill"] is False
    content = "Alpha one. " + _long_prompt()
    a1 = chat(server, content, 16, custom_params={"sparse": {"alpha": 1.0}})
    dense = chat(cpu_server, content, 16)
    assert a1["usage"]["prompt_tokens"] > MIN_CONTEXT
    assert a1["choices"][0]["message"]["content"] == dense["choices"][0]["message"]["content"]
    rep = a1["metadata"]["sparse"]
    assert rep["alpha"] == 1.0 and rep["sparse_prefill"] is False and rep["sparse_decode_steps"] == 0


def test_sparse_prefill_and_decode_above_min_context_retrieve_the_fact(ls_server):
    server, log = ls_server
    before = _stats(server)["stats"]
    r = chat(server, "Sparse run. " + _long_prompt(), 24)
    assert r["usage"]["prompt_tokens"] > MIN_CONTEXT
    assert "4817" in r["choices"][0]["message"]["content"]
    rep = r["metadata"]["sparse"]
    assert rep["mode"] == "loopserve" and rep["alpha"] == ALPHA and rep["sparse_prefill"] is True
    assert rep["vertical_lines"] > 0 and rep["slash_lines"] > 0
    assert 0 < rep["line_fraction"] < 1.0                      # fewer lines than dense prefill
    assert ALPHA - 1e-4 <= rep["covered_mass"] <= 1.0 + 1e-6   # Alg. 2's bound, mean over layers x heads
    n_out = r["usage"]["completion_tokens"]
    assert rep["steps"] == n_out and rep["sparse_decode_steps"] == n_out - 1
    assert 0 < rep["decode_tokens_read"] < rep["decode_tokens_total"]
    after = _stats(server)["stats"]
    assert after["sparse_prefills"] == before["sparse_prefills"] + 1
    assert after["vertical_lines"] - before["vertical_lines"] == rep["vertical_lines"]
    m = _metrics_when(server, "sglang_sparse:loopserve_sparse_prefills_total", lambda v: v >= after["sparse_prefills"])
    assert m["sglang_sparse:loopserve_sparse_prefills_total"] == after["sparse_prefills"]
    assert m["sglang_sparse:loopserve_vertical_lines_total"] == after["vertical_lines"]
    assert m["sglang_sparse:loopserve_slash_lines_total"] == after["slash_lines"]
    assert "sglang_sparse:loopserve_covered_mass_count" in m
    text = log.read_text(errors="replace").lower()
    assert "traceback" not in text and "leak" not in text


def test_default_dense_prefill_selects_lines_and_answers_its_first_token_as_off(ls_server, cpu_server):
    """prefill "dense" (default): the stock attention computes an engaged prefill, so the token it yields is
    off's; LoopServe still selects the lines the decode reads, and the decode after it runs sparse."""
    server, _ = ls_server
    content = "Dense prefill. " + _long_prompt()
    one = chat(server, content, 1)
    assert one["usage"]["prompt_tokens"] > MIN_CONTEXT
    assert one["choices"][0]["message"]["content"] == chat(cpu_server, content, 1)["choices"][0]["message"]["content"]
    rep = one["metadata"]["sparse"]
    assert rep["sparse_prefill"] is True and rep["vertical_lines"] > 0 and 0 < rep["line_fraction"] < 1.0
    more = chat(server, content, 6, ignore_eos=True)["metadata"]["sparse"]
    assert more["sparse_decode_steps"] == 5 and more["decode_tokens_read"] < more["decode_tokens_total"]


def test_progressive_decode_reselects_top_b_every_n_d_tokens(ls_server):
    server, _ = ls_server
    content = "Decode run. " + _long_prompt().replace("Answer with the number only.",
                                                      "Then explain the text in detail.")
    r = chat(server, content, 40, custom_params={"sparse": {"budget": 64}}, ignore_eos=True)
    rep = r["metadata"]["sparse"]
    n_out = r["usage"]["completion_tokens"]
    assert n_out == 40
    # Alg. 3: the 16th generated token and every n_d = 16 after: tokens 16 and 32
    assert rep["reselections"] == 2
    assert rep["decode_read_fraction"] < 1.0
    big = chat(server, content, 4, custom_params={"sparse": {"budget": 100000, "alpha": 0.1}})
    assert big["metadata"]["sparse"]["alpha"] == 0.5  # clamped to min_request_alpha


def test_multi_turn_dsl_reuses_turn_one_lines_in_turn_two(ls_server):
    import sglang as sgl

    server, _ = ls_server
    text = topics["assignment"][:1500]

    @sgl.function
    def conversation(s):
        s += sgl.system("You are a helpful assistant. Answer briefly.")
        s += sgl.user(f"Read this text.\n\n{text}\n\nThe secret number is 4817. What is the secret number?")
        s += sgl.assistant(sgl.gen("a0", max_tokens=12, temperature=0))
        s += sgl.user("Repeat the secret number.")
        s += sgl.assistant(sgl.gen("a1", max_tokens=12, temperature=0))

    before_stats = _stats(server)["stats"]
    before = _metrics(server)
    state = conversation.run(backend=sgl.RuntimeEndpoint(server.url, chat_template_name="chatml"))
    assert state.get_meta_info("a1")["cached_tokens"] > MIN_CONTEXT  # turn 2 is a radix prefix hit
    after_stats = _stats(server)["stats"]
    assert after_stats["sparse_prefills"] == before_stats["sparse_prefills"] + 2
    assert after_stats["stored_turns"] >= before_stats["stored_turns"] + 1
    key = "sglang_sparse:loopserve_reused_lines_total"
    after = _metrics_when(server, key, lambda v: v >= after_stats["reused_lines"])
    reused = after[key] - before.get(key, 0.0)
    assert reused > 0, (before, after)
    assert after[key] == after_stats["reused_lines"]
    assert after["sglang_sparse:loopserve_line_store_bytes"] > 0


@pytest.mark.parametrize("bad, needle", [
    ({"alpha": 0}, "custom_params.sparse.alpha = 0 is out of range"),
    ({"alpha": 1.5}, "expected a number in (0, 1]"),
    ({"budget": 2.5}, "custom_params.sparse.budget = 2.5 is not an integer"),
    ({"epsilon": 0.9}, "unknown key(s) 'epsilon'"),
])
def test_bad_per_request_options_get_a_400(ls_server, bad, needle):
    server, _ = ls_server
    r = requests.post(server.url + "/v1/chat/completions", timeout=120, json={
        "model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
        "custom_params": {"sparse": bad}})
    assert r.status_code == 400, r.text
    assert needle in r.text


def test_concurrent_dense_and_sparse_rows_share_batches(ls_server, cpu_server):
    """A short (dense) and a long (sparse) request in flight together: mixed batches run the stock path for
    every row and overwrite the sparse ones; all-sparse batches skip the stock attention. The long one is
    sparse throughout; the short one answers exactly as dense."""
    from concurrent.futures import ThreadPoolExecutor

    server, log = ls_server
    short_msg, long_msg = PROMPT[0]["content"], "Mixed run. " + _long_prompt()
    with ThreadPoolExecutor(2) as ex:
        fs = [ex.submit(chat, server, m, 16, ignore_eos=True) for m in (long_msg, short_msg)]
        long_r, short_r = (f.result() for f in fs)
    assert long_r["metadata"]["sparse"]["sparse_prefill"] is True
    assert long_r["metadata"]["sparse"]["sparse_decode_steps"] == 15
    assert short_r["metadata"]["sparse"]["sparse_prefill"] is False
    assert short_r["choices"][0]["message"]["content"] == \
        chat(cpu_server, short_msg, 16, ignore_eos=True)["choices"][0]["message"]["content"]
    text = log.read_text(errors="replace").lower()
    assert "traceback" not in text and "leak" not in text


def test_turns_bench_reports_lines_reused_from_earlier_turns(ls_server, cpu_server, default_model, tmp_path):
    """bench.loopserve_turns through both servers: turn 2 is a radix prefix hit, its prefill runs sparsely with
    lines of turn 1 found on the radix path (reused fraction in (0, 1)); off reports no lines; ratios present."""
    from bench import loopserve_turns

    server, _ = ls_server
    rc = loopserve_turns.main(["--model", str(default_model), "--device", "cpu", "--configs", "off,loopserve",
                               "--url", f"off={cpu_server.url}", "--url", f"loopserve={server.url}",
                               "--turns", "2", "--turn-tokens", "320", "--conversations", "1",
                               "--max-new-tokens", "4", "--timeout", "300", "--out", str(tmp_path)])
    assert rc == 0
    rep = json.loads((tmp_path / "loopserve_turns.json").read_text())
    ls, off = rep["configs"]["loopserve"]["turns"], rep["configs"]["off"]["turns"]
    assert [r["turn"] for r in ls] == [1, 2] and all(r["failed"] == 0 for r in ls + off)
    assert ls[1]["input_tokens_mean"] == 2 * 320 + 4 and ls[1]["cached_tokens_mean"] >= 320
    assert ls[0]["sparse_prefill_share"] == 1.0 and ls[0]["reused_lines"] == 0
    assert ls[1]["sparse_prefill_share"] == 1.0 and ls[1]["reused_lines"] > 0
    assert 0.0 < ls[1]["reused_fraction"] < 1.0 and 0.0 < ls[1]["line_fraction"] < 1.0
    assert off[1]["reused_lines"] == 0 and off[1]["reused_fraction"] is None
    assert ls[0]["ttft_vs_turn1"] == 1.0 and ls[1]["ttft_vs_off"] > 0 and off[1]["ttft_vs_off"] is None
    assert "| loopserve | 2 |" in (tmp_path / "loopserve_turns.md").read_text()
