"""Contract (GPU): under ``--enable-deterministic-inference`` a request that `--sparse loopserve` never engages decodes
exactly as `--sparse off` does (same tokens, bitwise-equal logprobs), also while it shares its decode batches with an
engaged request. Such mixed batches run eagerly (here at a batch size the graphs cover); SGLang plans eager FlashInfer
decode with 2048-token KV splits but replays its graphs unsplit, so without :mod:`sglang_sparse.deterministic` the
stock rows rounded differently from `off`'s replayed steps. The engaged request is still decoding when the stock one
has finished, so every decode step of the stock one was a mixed batch.

Above ``--cuda-graph-max-bs`` SGLang decodes eagerly under `off` too, with the split plan: there the stock rows of a
loopserve batch must keep that split plan (planning them unsplit, as below the graph sizes, would round them unlike
`off`'s).

An engaged request's own decode is batch invariant too: loopserve's split decode plans every batch as a batch of one
row under deterministic inference, so the request decodes alone and beside another engaged request bit for bit."""

from __future__ import annotations

import random
import threading
import time

import pytest

from bench.corpus import haystack
from tests.serverproc import chat, flush_cache
from tests.test_gpu_loopserve_server import off_and_sparse

pytestmark = [pytest.mark.gpu, pytest.mark.server]

MIN_CONTEXT = 4096
ARGS = ["--attention-backend", "flashinfer", "--mem-fraction-static", "0.2", "--cuda-graph-max-bs", "4",
        "--enable-deterministic-inference"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    with off_and_sparse(tmp_path_factory.mktemp("gpu_det_mixed"), f'{{"min_context": {MIN_CONTEXT}}}',
                        args=ARGS) as pair:
        yield pair


def _prompt(n_words: int, seed: int) -> str:
    text = "\n\n".join(haystack(n_words, random.Random(seed)))
    return f"Read this text.\n\n{text}\n\nSummarise the text in one paragraph."


def _logprobs(reply) -> list[float]:
    return [t["logprob"] for t in reply["choices"][0]["logprobs"]["content"]]


def test_gpu_deterministic_stock_rows_of_mixed_batches_equal_off(servers):
    dense, sparse = servers
    short = _prompt(2300, seed=1)  # ~3k tokens: > 2048 (one eager decode split), < MIN_CONTEXT
    long = _prompt(4500, seed=2)   # ~6k tokens: engaged
    ref = chat(dense, short, 48, ignore_eos=True, logprobs=True)
    assert 2048 < ref["usage"]["prompt_tokens"] < MIN_CONTEXT
    engaged = {}

    def run_long():
        engaged["reply"] = chat(sparse, long, 1000, ignore_eos=True)  # 5.7k + 1000 < 8192

    t = threading.Thread(target=run_long)
    t.start()
    time.sleep(0.5)  # the engaged request is decoding when the stock one joins its batches
    mixed = chat(sparse, short, 48, ignore_eos=True, logprobs=True)
    overlapped = t.is_alive()  # the engaged request outlived the stock one: their decode steps were batched together
    t.join()
    assert overlapped
    rep = engaged["reply"]["metadata"]["sparse"]
    assert engaged["reply"]["usage"]["prompt_tokens"] > MIN_CONTEXT and rep["sparse_decode_steps"] > 0
    assert mixed["metadata"]["sparse"].get("sparse_decode_steps", 0) == 0
    assert mixed["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"]
    assert _logprobs(mixed) == _logprobs(ref)


def _background(server, prompts: list[str], tokens: int) -> list[threading.Thread]:
    threads = [threading.Thread(target=chat, args=(server, p, tokens), kwargs=dict(ignore_eos=True)) for p in prompts]
    for t in threads:
        t.start()
    return threads


def test_gpu_deterministic_stock_rows_above_graph_batch_sizes_equal_off(servers):
    """Both servers decode the probe beside five long-running requests (a batch of 6 > ``--cuda-graph-max-bs`` 4,
    eager and split on both); loopserve's five include one engaged request. The probe's tokens and logprobs are
    bitwise equal, and every background request outlived it (each probe step was a batch of 6)."""
    dense, sparse = servers
    probe = _prompt(2300, seed=3)                       # ~3k tokens: stock rows on both servers, > one 2048 split
    stock_bg = [_prompt(2300, seed=10 + i) for i in range(5)]
    replies = {}
    for name, server, bg in (("off", dense, stock_bg), ("loopserve", sparse, [_prompt(4500, seed=2)] + stock_bg[1:])):
        threads = _background(server, bg, 1000)
        time.sleep(2.0)  # every background request is decoding when the probe arrives
        replies[name] = chat(server, probe, 48, ignore_eos=True, logprobs=True)
        alive = [t.is_alive() for t in threads]
        for t in threads:
            t.join()
        assert all(alive), f"{name}: a background request finished before the probe ({alive})"
    assert 2048 < replies["off"]["usage"]["prompt_tokens"] < MIN_CONTEXT
    assert replies["loopserve"]["metadata"]["sparse"].get("sparse_decode_steps", 0) == 0
    assert replies["loopserve"]["choices"][0]["message"]["content"] == replies["off"]["choices"][0]["message"]["content"]
    assert _logprobs(replies["loopserve"]) == _logprobs(replies["off"])


def test_gpu_deterministic_engaged_request_decodes_the_same_alone_and_beside_another(servers):
    """The same engaged request (one prefill chunk, the radix cache flushed before each run, so both prefills and
    line selections are alone and equal) decoded alone and beside a longer engaged request: same tokens, bitwise
    equal logprobs."""
    _, sparse = servers
    probe = _prompt(4500, seed=4)  # ~5.7k tokens: engaged, one prefill chunk
    flush_cache(sparse)
    alone = chat(sparse, probe, 64, ignore_eos=True, logprobs=True)
    assert alone["usage"]["prompt_tokens"] > MIN_CONTEXT and alone["metadata"]["sparse"]["sparse_decode_steps"] > 0
    flush_cache(sparse)
    threads = _background(sparse, [_prompt(4500, seed=2)], 1000)
    time.sleep(1.0)  # the other engaged request is decoding when the probe arrives
    beside = chat(sparse, probe, 64, ignore_eos=True, logprobs=True)
    overlapped = threads[0].is_alive()
    threads[0].join()
    assert overlapped
    assert beside["metadata"]["sparse"]["sparse_decode_steps"] > 0
    assert beside["choices"][0]["message"]["content"] == alone["choices"][0]["message"]["content"]
    assert _logprobs(beside) == _logprobs(alone)
