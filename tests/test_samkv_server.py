"""Contract (CPU, real SmolLM2-135M server): `--sparse samkv` serves `extra_body.documents` end to end.

Documents are prefilled and cached alone (per salt), a request's composite context is assembled from
their KV in the scheduler and reused as its prefix (only the question is extended: `cached_tokens`),
the planted fact is retrieved, salts isolate, the `samkv` variant keeps at most `max_kept_ratio` of the
document tokens (the token cap of `sglang_sparse.samkv.select`), `recompute` is the dense baseline, bad payloads are 400s naming the field and the
server keeps serving, a streamed request streams the same reply (and shows in the server counters), and
the DSL helper reaches the same path. The server log stays free of tracebacks and KV-leak reports."""

from __future__ import annotations

import pytest
import requests

from bench.samkv_bench import correct, make_task
from tests.serverproc import DEFAULT_MODEL, flush_cache, sparse_metrics_when, start_cpu_server

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def samkv_server(default_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("samkv") / "server.log"
    # min_document_tokens 1024 (default 4096): the requests of the rules that pick the variant stay short on a CPU
    handle = start_cpu_server(default_model, log, mode="samkv",
                              sparse_config='{"block_size": 16, "min_document_tokens": 1024}',
                              extra_args=("--enable-metrics",))
    try:
        yield handle, log
    finally:
        handle.stop()


def _ask(server, task, *, variant=None, salt=None, max_tokens=12, endpoint="chat", **extra):
    q = f"What is {task.name}'s secret number? Answer the question above with the number only."
    body = {"model": "default", "max_tokens": max_tokens, "temperature": 0, "documents": list(task.documents), **extra}
    if endpoint == "chat":
        body["messages"] = extra.pop("messages", None) or [{"role": "user", "content": q}]
    else:
        body["prompt"] = f"Question: {q}\nAnswer:"
    if variant:
        body["samkv"] = {"variant": variant}
    if salt:
        body["cache_salt"] = salt
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    return requests.post(server.url + path, json=body, timeout=600, stream=bool(extra.get("stream")))


def _text(r):
    c = r.json()["choices"][0]
    return c["message"]["content"] if "message" in c else c["text"]


def test_documents_reused_fact_retrieved_and_salts_isolate(samkv_server):
    server, log = samkv_server
    task = make_task(1, docs=3, words=120)
    first = _ask(server, task, variant="reuse", salt="a")
    assert first.status_code == 200, first.text
    m1 = first.json()["metadata"]["sparse"]
    assert m1["documents"] == 3 and m1["documents_prefilled"] == 3 and m1["documents_reused"] == 0
    assert m1["assembled"] and m1["cached_tokens"] >= m1["document_tokens"]  # composite from the documents' KV
    assert m1["computed_tokens"] == m1["question_tokens"] and m1["kv_kept_ratio"] == 1.0
    assert correct(_text(first), task.answer), _text(first)
    assert m1["layout"] == "in_user_turn" and m1["prefix_tokens"] > 0  # inside the user turn, behind the header
    # the same documents in another order: every document reused, only the question computed
    shuffled = type(task)(**{**task.__dict__, "documents": tuple(reversed(task.documents))})
    m2 = _ask(server, shuffled, variant="reuse", salt="a").json()["metadata"]["sparse"]
    assert m2["documents_reused"] == 3 and m2["documents_prefilled"] == 0 and m2["assembled"]
    assert m2["cached_tokens"] >= m2["document_tokens"] and m2["computed_tokens"] == m2["question_tokens"]
    # /v1/completions has no turns: the documents go before the prompt, cached behind no prefix (its own entries)
    third = _ask(server, task, variant="reuse", salt="a", endpoint="completions").json()["metadata"]["sparse"]
    assert third["layout"] == "before_prompt" and third["prefix_tokens"] == 0 and third["assembled"]
    # another salt: nothing shared
    other = _ask(server, task, variant="reuse", salt="b").json()["metadata"]["sparse"]
    assert other["documents_prefilled"] == 3 and other["documents_reused"] == 0
    # dense baseline: the whole concatenation computed
    dense = _ask(server, task, variant="recompute", salt="a")
    md = dense.json()["metadata"]["sparse"]
    assert md["cached_tokens"] == 0 and md["computed_tokens"] == md["context_tokens"] == m1["context_tokens"]
    assert "secret number" in _text(dense)  # (SmolLM2-135M's dense answer to this task is wrong: '3')
    text = log.read_text(errors="replace").lower()
    assert "traceback" not in text and "leak" not in text


def test_short_documents_are_recomputed_unless_the_request_names_a_variant(samkv_server):
    """~700 document tokens are below the server's min_document_tokens (1024 here): a request naming no variant is
    served by recompute (the stock inline prompt), says why, and answers as the inline prompt does."""
    server, _ = samkv_server
    task = make_task(2, docs=3, words=160)
    r = _ask(server, task, salt="short")
    assert r.status_code == 200, r.text
    m = r.json()["metadata"]["sparse"]
    assert m["variant"] == "recompute" and m["scheduler_status"] == "recompute" and not m["assembled"], m
    assert m["variant_reason"] == f"{m['document_tokens']} document tokens, below min_document_tokens (1024)"
    assert m["kept_ranges"] is None and m["documents_prefilled"] == 3  # nothing cached for reuse
    named = _ask(server, task, variant="recompute", salt="short")
    assert _text(named) == _text(r) and named.json()["metadata"]["sparse"]["variant_reason"] is None


def test_many_short_documents_whose_budget_keeps_no_middle_are_recomputed(samkv_server):
    """8 documents of ~120 words (~1.6k tokens): above min_document_tokens in all, but 0.2 of their tokens is
    spent on each one's first and last blocks (16-token blocks here), with fewer middle blocks left than documents
    (min_middle_blocks 1): a request naming no variant is served by recompute and says why (a request naming its
    variant gets it: test_samkv_variant_keeps_fewer_blocks_and_reuses)."""
    server, _ = samkv_server
    task = make_task(4, docs=8, words=120)
    r = _ask(server, task, salt="many", max_tokens=1)
    assert r.status_code == 200, r.text
    m = r.json()["metadata"]["sparse"]
    assert m["document_tokens"] >= 1024, m
    assert m["variant"] == "recompute" and not m["assembled"], m
    assert m["variant_reason"].startswith("the kept budget holds ") and \
        m["variant_reason"].endswith("middle blocks for 8 documents, below min_middle_blocks (1) per document"), m


def test_samkv_variant_keeps_fewer_blocks_and_reuses(samkv_server):
    server, log = samkv_server
    task = make_task(2, docs=3, words=160)
    _ask(server, task, variant="reuse", max_tokens=1)  # documents cached
    r = _ask(server, task, variant="samkv")  # named: short documents go through the assembly as asked
    assert r.status_code == 200, r.text
    m = r.json()["metadata"]["sparse"]
    assert m["variant"] == "samkv" and m["documents_reused"] == 3 and m["assembled"] and m["variant_reason"] is None
    assert 0 < m["kv_kept_tokens"] < m["document_tokens"] and m["kv_kept_ratio"] < 1.0
    # the default max_kept_ratio (0.2) holds in tokens: 3 x ~200-token documents with 16-token blocks, whose
    # 1 initial + 2 local blocks alone are ~0.24 (kept before the token cap), so local blocks are trimmed
    assert m["kv_kept_tokens"] <= int(0.2 * m["document_tokens"]), m
    # the prompt became kept document tokens + question; the kept context came from the cache
    assert m["context_tokens"] == m["prefix_tokens"] + m["kv_kept_tokens"] + m["question_tokens"]
    assert m["cached_tokens"] >= m["kv_kept_tokens"] - 1
    text = log.read_text(errors="replace").lower()
    assert "traceback" not in text and "leak" not in text


def test_samkv_finds_a_fact_in_a_dropped_middle_block_under_the_kv_cap(samkv_server):
    """4 documents of ~400 words; the fact sits at tokens 98-109 of the 511-token needed document (neither its
    initial nor its last blocks). Under the 0.2 cap ~80 % of the KV is dropped; the question-mass selection
    must keep the fact's block (the paper's rule, selection=anchor_top_p, kept it in 2 of 8 such CPU tasks)."""
    from bench.samkv_bench import WORDINGS, ask

    server, _ = samkv_server
    task = make_task(2, docs=4, words=400)
    ask(server.url, task, "reuse", 1, wording=len(WORDINGS) - 1, style="completion")  # documents cached
    dense = ask(server.url, task, "recompute", 12, style="completion")
    assert correct(dense["text"], task.answer), dense["text"]
    got = ask(server.url, task, "samkv", 12, style="completion")
    m = got["sparse"]
    assert m["variant"] == "samkv" and m["assembled"] and m["documents_reused"] == 4, m
    assert m["kv_kept_tokens"] <= int(0.2 * m["document_tokens"]), m
    assert correct(got["text"], task.answer), (got["text"], m)
    # the reply says which parts of each document were kept: they add up to the kept tokens and hold the fact
    from bench.samkv_bench import fact_kept, load_tokenizer

    ranges = m["kept_ranges"]
    assert len(ranges) == 4 and sum(e - s for r in ranges for s, e in zip(r[::2], r[1::2])) == m["kv_kept_tokens"]
    tokenizer = load_tokenizer(str(DEFAULT_MODEL))
    assert fact_kept(tokenizer, task, ranges) is True
    assert fact_kept(tokenizer, task, [[0, 16]] * 4) is False   # the fact is not in the first block
    assert dense["sparse"]["kept_ranges"] is None               # recompute: nothing assembled


@pytest.mark.parametrize("extra,fragment", [
    ({"documents": []}, "'documents' must hold at least one document"),
    ({"documents": ["ok", ""]}, "'documents[1]' is empty"),
    ({"documents": "one string"}, "'documents' must be a list of strings"),
    ({"documents": ["ok", 3]}, "'documents[1]' must be a string"),
    ({"documents": ["word " * 9000]}, "'documents' is too long for the context"),
    ({"documents": ["ok"], "cache_salt": 5}, "'cache_salt'"),  # pydantic's own 400 names it
    ({"documents": ["ok"], "samkv": {"variant": "bogus"}}, "'samkv.variant'='bogus' must be one of"),
])
def test_bad_documents_payloads_are_400_and_server_keeps_serving(samkv_server, extra, fragment):
    server, _ = samkv_server
    body = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **extra}
    r = requests.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 400, r.text
    assert fragment in r.json()["message"]
    ok = requests.post(server.url + "/v1/chat/completions", timeout=120, json={
        "model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert ok.status_code == 200 and "sparse" not in (ok.json().get("metadata") or {})


def _samkv_stats(server):
    info = requests.get(server.url + "/server_info", timeout=60).json()
    return info["internal_states"][0]["sparse"]["samkv"]


def _streamed(r):
    """(text, usage of the last chunk that has one) of an SSE response."""
    import json

    parts, usage = [], None
    for line in r.iter_lines(decode_unicode=True):
        if not line or not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[len("data: "):])
        usage = chunk.get("usage") or usage
        for c in chunk.get("choices") or []:
            parts.append((c.get("delta") or {}).get("content") or c.get("text") or "")
    return "".join(parts), usage


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_streamed_documents_request_streams_the_same_reply(samkv_server, endpoint):
    server, log = samkv_server
    task = make_task(3, docs=2, words=80)
    plain = _ask(server, task, variant="reuse", salt="stream", endpoint=endpoint)
    assert plain.status_code == 200, plain.text
    before = _samkv_stats(server)
    with _ask(server, task, variant="reuse", salt="stream", endpoint=endpoint, stream=True,
              stream_options={"include_usage": True}) as r:
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("text/event-stream")
        streamed, usage = _streamed(r)
    assert streamed and streamed == _text(plain)
    # the documents were in the streamed request's context (kept context + question), not dropped
    m = plain.json()["metadata"]["sparse"]
    assert usage["prompt_tokens"] == plain.json()["usage"]["prompt_tokens"] == m["context_tokens"]
    assert m["context_tokens"] > m["question_tokens"] + m["document_tokens"] // 2
    # its figures are in the server counters (/server_info and /metrics): one more assembled request
    after = _samkv_stats(server)
    assert after["requests"] == before["requests"] + 1
    assert after["by_status"]["assembled"] == before["by_status"]["assembled"] + 1
    assert after["document_tokens"] - before["document_tokens"] == m["document_tokens"]
    assert after["kept_tokens"] - before["kept_tokens"] == m["kv_kept_tokens"] and after["kv_kept_ratio"] > 0
    metrics = sparse_metrics_when(server, "sglang_sparse:samkv_", "sglang_sparse:samkv_document_tokens_total",
                                  lambda v: v >= after["document_tokens"])
    assert metrics["sglang_sparse:samkv_document_tokens_total"] == after["document_tokens"]
    text = log.read_text(errors="replace").lower()
    assert "traceback" not in text and "leak" not in text


def test_dsl_helper_passes_documents(samkv_server):
    import sglang as sgl

    from sglang_sparse.samkv.dsl import gen_with_documents

    server, _ = samkv_server
    task = make_task(3, docs=2, words=100)

    @sgl.function
    def qa(s, docs, name):
        s += f"Question: What is {name}'s secret number?\nAnswer:"
        gen_with_documents(s, "answer", docs, max_tokens=8, cache_salt="dsl", variant="reuse")

    state = qa.run(docs=list(task.documents), name=task.name, backend=sgl.RuntimeEndpoint(server.url))
    assert correct(state["answer"], task.answer), state["answer"]
    meta = state.get_var("answer_sparse")
    assert meta["documents"] == 2 and meta["variant"] == "reuse" and meta["assembled"]
    assert state.text().endswith(state["answer"])
    with pytest.raises(ValueError, match="documents\\[0\\]"):
        qa.run(docs=[""], name="x", backend=sgl.RuntimeEndpoint(server.url)).get_var("answer")


def test_bench_smoke_runs_both_sets_and_writes_computed_headline(samkv_server, tmp_path):
    import json

    from bench.samkv_bench import SMOKE, VARIANTS, main

    server, _ = samkv_server
    assert main(["--url", server.url, "--smoke", "--device", "cpu", "--out", str(tmp_path)]) == 0
    head = json.loads((tmp_path / "samkv.json").read_text())
    res = head["details"]
    acc, tt = res["accuracy_set"], res["ttft_set"]
    # both sets ran, at the smoke sizes; every variant answered every accuracy task
    assert len(acc["rows"]) == SMOKE.accuracy.tasks and len(tt["rows"]) == SMOKE.ttft.tasks
    assert set(acc["accuracy"]) == set(VARIANTS) and all(set(r["replies"]) == set(VARIANTS) for r in acc["rows"])
    assert tt["rows"][0]["document_tokens"] > 100 and tt["rows"][0]["warm_documents_prefilled"] in (0, 2)
    # each timed samkv request's latency split around the scheduler's assembly (same-host wall clocks)
    wall = tt["rows"][0]["samkv_timing_ms"][-1]["wall_ms"]
    assert wall["before_ms"] >= 0 and wall["after_ms"] >= 0 and wall["assembly_ms"] > 0, wall
    # headline figures are computed from their own set, and the report says which set
    assert set(head) >= {"gpu", "ttft_ratio_vs_recompute", "kv_kept_ratio", "accuracy_delta_vs_recompute"}
    assert all(isinstance(head[k], float) for k in ("ttft_ratio_vs_recompute", "kv_kept_ratio",
                                                    "accuracy_delta_vs_recompute"))
    assert head["ttft_ratio_vs_recompute"] == tt["ttft_median_s"]["samkv"] / tt["ttft_median_s"]["recompute"]
    assert head["kv_kept_ratio"] == tt["kv_kept_ratio"] and 0 < head["kv_kept_ratio"] <= 1.0
    assert head["accuracy_delta_vs_recompute"] == 100.0 * (acc["accuracy"]["samkv"] - acc["accuracy"]["recompute"])
    assert head["figure_sources"]["accuracy_delta_vs_recompute"].startswith("accuracy set")
    assert head["figure_sources"]["ttft_ratio_vs_recompute"].startswith("TTFT set")
    # reuse / cacheblend keep every document token; the recompute baseline computes the whole context
    meta = acc["rows"][0]["metadata"]
    assert meta["reuse"]["kv_kept_ratio"] == 1.0 and meta["cacheblend"]["kv_kept_ratio"] == 1.0
    assert meta["cacheblend"]["recomputed_tokens"] > 0 and meta["reuse"]["recomputed_tokens"] == 0
    assert meta["recompute"]["cached_tokens"] == 0
    md = (tmp_path / "samkv.md").read_text()
    assert "| TTFT samkv / full recompute" in md and "Accuracy set:" in md and "TTFT set:" in md


def test_evicted_documents_fall_back_to_dense_then_are_prefilled_again(samkv_server):
    server, log = samkv_server
    task = make_task(5, docs=2, words=80)
    assert _ask(server, task, variant="reuse", salt="evict").json()["metadata"]["sparse"]["documents_prefilled"] == 2
    flush_cache(server)  # the tree forgets the documents
    before = _samkv_stats(server)["fallback_reasons"].get("document not cached", 0)
    stale = _ask(server, task, variant="reuse", salt="evict")
    m = stale.json()["metadata"]["sparse"]
    assert stale.status_code == 200 and m["scheduler_status"] == "fallback" and m["cached_tokens"] == 0
    # why: in the response and in the server counters
    assert m["scheduler_reason"] == "document not cached"
    assert _samkv_stats(server)["fallback_reasons"]["document not cached"] == before + 1
    again = _ask(server, task, variant="reuse", salt="evict").json()["metadata"]["sparse"]
    assert again["documents_prefilled"] == 2 and again["assembled"]
    text = log.read_text(errors="replace").lower()
    assert "traceback" not in text and "leak" not in text


def test_rag_bench_scores_every_variant_against_the_stock_inline_prompt(samkv_server, tmp_path):
    """``bench.samkv_rag`` on the real server: every variant and the stock inline prompt answer the same task;
    the TTFT set times samkv, stock inline and recompute; the headline keys land in samkv.json."""
    import json

    from bench import samkv_rag as R

    server, _ = samkv_server
    flush_cache(server)
    acc = R.run_accuracy(server.url, R.SMOKE, log=lambda *_: None)
    assert acc["n"] == 1 and set(acc["accuracy"]) == {"stock_inline", "recompute", "samkv"}
    assert all(0.0 <= v <= 1.0 for v in acc["accuracy"].values())
    assert acc["rows"][0]["samkv_status"] in ("assembled", "too_short", "fallback")
    tt = R.run_ttft(server.url, R.SMOKE, log=lambda *_: None)
    assert set(tt["ttft_median_s"]) == {"samkv", "stock_inline", "recompute"} and tt["ttft_ratio_vs_stock_inline"] > 0
    inline = tt["rows"][0]["samkv_phases"][0]
    assert inline["stock_inline_cached_tokens"] < inline["stock_inline_prompt_tokens"] / 2  # documents not cached
    head = tmp_path / "samkv.json"
    head.write_text(json.dumps({"ttft_ratio_vs_recompute": 0.5}))
    got = R.merge_headline(head, {"accuracy_set": acc, "ttft_set": tt}, R.SMOKE)
    assert got["baseline"] == "stock_inline" and got["ttft_ratio_vs_recompute"] == 0.5
    assert got["accuracy_delta_vs_stock_inline"] == acc["delta_vs_stock_inline_points"]["samkv"]
    assert got["ttft_ratio_vs_stock_inline"] == tt["ttft_ratio_vs_stock_inline"]


def test_rag_bench_gives_paired_intervals_per_document_count():
    """``summarize_accuracy``: per document count, each variant's paired 95 % interval of the difference to the stock
    inline prompt, in points (None below two tasks)."""
    from bench import samkv_rag as R

    def row(docs, inline, samkv):
        return {"docs": docs, "score": {"stock_inline": inline, "samkv": samkv}, "kv_kept_ratio": 0.2}

    rows = [row(4, 0.0, 1.0), row(4, 0.0, 1.0), row(4, 1.0, 1.0), row(4, 0.0, 0.0), row(8, 1.0, 0.0)]
    acc = R.summarize_accuracy(rows, ("stock_inline", "samkv"))
    lo, hi = acc["accuracy_by_docs"]["4"]["delta_ci95_points"]["samkv"]
    assert lo < 50.0 < hi and hi - lo == pytest.approx(2 * 1.96 * 57.735 / 2, rel=1e-3)  # mean 0.5, sd 0.577, n 4
    assert acc["accuracy_by_docs"]["8"]["delta_ci95_points"]["samkv"] is None
    assert acc["delta_ci95_points"]["samkv"] is not None and acc["accuracy_by_docs"]["4"]["n"] == 4


def _limits_chat(server, **extra):
    return requests.post(server.url + "/v1/chat/completions", timeout=300, json={
        "model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0,
        **extra})


@pytest.mark.parametrize("route,extra,field,fragment", [
    ("chat", {"cache_salt": "s" * 1_000_000}, "cache_salt", "'cache_salt' has 1000000 characters; at most 256"),
    ("chat", {"cache_salt": "s" * 257, "documents": ["a doc"]}, "cache_salt", "'cache_salt' has 257 characters"),
    ("completions", {"extra_key": "k" * 5000}, "extra_key", "'extra_key' has 5000 characters"),
    ("chat", {"custom_params": {"samkv_spans": [0, 1]}}, "custom_params", "'samkv_spans'"),
    ("chat", {"documents": ["d"] * 65}, None, "'documents' holds 65 documents; at most 64 are allowed"),
    ("chat", {"documents": ["x" * 3_000_000, "y" * 1_000_001]}, None,
     "'documents' is too long: 4000001 characters up to 'documents[1]' exceed the limit of 4000000"),
    ("generate", {"extra_key": "k" * 100_000}, "extra_key", "'extra_key' has 100000 characters"),
    ("generate", {"sampling_params": {"max_new_tokens": 2, "custom_params": {"samkv_doc_ns": "x"}}},
     "sampling_params.custom_params", "'samkv_doc_ns'"),
], ids=["salt_1MB", "salt_257_documents", "extra_key", "reserved_custom", "documents_count", "documents_chars",
        "generate_extra_key", "generate_reserved_custom"])
def test_client_controlled_sizes_past_their_cap_are_400_naming_the_field(samkv_server, route, extra, field,
                                                                        fragment):
    """What a client controls and the server keys caches by or keeps is bounded (sglang_sparse.client_limits;
    the documents caps at their defaults, max_documents 64 and max_document_chars 4,000,000, checked before
    anything is tokenised): an HTTP 400 naming the field, and the server serves on, at the caps too."""
    server, _ = samkv_server
    if route == "generate":
        body = {"text": "Hi", "sampling_params": {"max_new_tokens": 2}, **extra}
        r = requests.post(server.url + "/generate", json=body, timeout=300)
    elif route == "completions":
        r = requests.post(server.url + "/v1/completions", timeout=300,
                          json={"model": "default", "prompt": "Hi", "max_tokens": 2, **extra})
    else:
        r = _limits_chat(server, **extra)
    assert r.status_code == 400, r.text
    assert fragment in r.json()["message"]
    if field is not None:
        assert r.json().get("param") == field
    ok = _limits_chat(server, cache_salt="s" * 256)  # at the cap: served, and the server serves on
    assert ok.status_code == 200, ok.text
    docs = _limits_chat(server, documents=["a" * 900, "b" * 900, "c" * 200], cache_salt="t" * 256)
    assert docs.status_code == 200 and docs.json()["metadata"]["sparse"]["documents"] == 3, docs.text
