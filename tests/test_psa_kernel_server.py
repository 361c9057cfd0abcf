"""Contract (CPU, Triton interpreter): the GPU runner's code path of `--sparse psa` — block metadata
rows per request block at SGLang's default page size 1, kept current at sparse decode steps,
criticality + ranking + progressive decode kernels — serves end to end through the stock server: below `min_context` the answer equals
`--sparse off`, above it decode reads fewer blocks and the per-request report adds up, and with `stock_rows`
'exact' a request below `min_context` decoding beside a sparse one gets `--sparse off`'s tokens and logprobs.
(`--sparse-config '{"runner": "kernel"}'` selects that runner on CPU; the interpreter makes it slow, so the
requests are short.)"""

from __future__ import annotations

import os

import pytest
import requests
from pydoc_data.topics import topics

from tests.serverproc import chat, start_cpu_server
from tests.test_server_e2e import PROMPT

pytestmark = pytest.mark.server

MIN_CONTEXT = 256


@pytest.fixture(scope="module")
def kernel_server(default_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("psa_kernel") / "server.log"
    saved = os.environ.get("TRITON_INTERPRET")  # the scheduler runs the Triton kernels through the interpreter
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        handle = start_cpu_server(default_model, log, mode="psa",
                                  sparse_config=f'{{"min_context": {MIN_CONTEXT}, "runner": "kernel", "dense_above": 1.0, '
                                                f'"stock_rows": "exact"}}',
                                  extra_args=("--max-running-requests", "4"))
    finally:
        os.environ.pop("TRITON_INTERPRET", None) if saved is None else os.environ.__setitem__("TRITON_INTERPRET", saved)
    try:
        yield handle, log
    finally:
        handle.stop()


def test_kernel_runner_below_min_context_equals_dense(kernel_server, cpu_server):
    server, log = kernel_server
    assert "rows per request block" in log.read_text()  # the kernel runner at page 1, not the reference
    a = chat(server, PROMPT[0]["content"], 12)
    b = chat(cpu_server, PROMPT[0]["content"], 12)
    assert a["usage"]["prompt_tokens"] < MIN_CONTEXT
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
    assert a["metadata"]["sparse"]["sparse_decode_steps"] == 0


def _kernel_prompt() -> str:
    """About 360 tokens (23 blocks of 16): above MIN_CONTEXT, and short, since the interpreted kernels' time grows
    with the context."""
    text = topics["assignment"][:1300]
    return (f"Read this text.\n\n{text[:650]}\n\nThe secret number is 4817.\n\n{text[650:]}\n\n"
            "What is the secret number? Answer with the number only.")


def test_kernel_runner_above_min_context_decodes_sparsely(kernel_server):
    server, _ = kernel_server
    # two tokens: one decode step through the interpreted kernels (30 layers of them take ~20 s a step)
    r = chat(server, _kernel_prompt(), 2, custom_params={"sparse": {"epsilon": 0.9}})
    rep = r["metadata"]["sparse"]
    assert r["usage"]["prompt_tokens"] > MIN_CONTEXT
    assert rep["epsilon"] == 0.9 and rep["sparse_decode_steps"] == r["usage"]["completion_tokens"] - 1 > 0
    assert 0 < rep["blocks_read"] < rep["blocks_total"] and 0.5 < rep["kept_mass"] <= 1.0 + 1e-6
    d = chat(server, _kernel_prompt(), 2, custom_params={"sparse": {"epsilon": 1.0}})
    assert d["metadata"]["sparse"]["sparse_decode_steps"] == 0
    stats = server.server_info()["internal_states"][0]["sparse"]["stats"]  # page 1: rows per request block
    assert stats["meta_rows_total"] > stats["meta_rows_used"] >= -(-rep["blocks_total"] // 30 // 3) > 0
    assert stats["meta_rebuilds"] >= 1 and stats["meta_row_shortfalls"] == 0


def _generate_together(server, texts: list[str], max_new_tokens: list[int]) -> list[dict]:
    """One ``/generate`` call with a batch of prompts: scheduled together, prefilled in one batch, then decoded in
    the same steps (greedy, with logprobs)."""
    r = requests.post(server.url + "/generate", timeout=900, json={
        "text": texts, "return_logprob": True,
        "sampling_params": [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in max_new_tokens]})
    r.raise_for_status()
    return r.json()


def test_exact_stock_rows_decode_as_off_beside_a_sparse_row(kernel_server, cpu_server):
    """`stock_rows: exact`: a request below min_context that decodes in the same steps as a sparse one takes the
    stock decode's output, so its tokens and logprobs are those `--sparse off` gives it in the same batch (the PSA
    kernel at epsilon 1 rounds differently: its first decode logprob moves in the 3rd digit)."""
    server, _ = kernel_server
    # the short request's one decode step runs beside the long one's first sparse step (each interpreted step is
    # ~20 s of 30 layers of kernels, so no more steps than the check needs)
    texts, lens = [PROMPT[0]["content"], _kernel_prompt()], [2, 3]
    short, long = _generate_together(server, texts, lens)
    ref, _ = _generate_together(cpu_server, texts, lens)
    assert short["meta_info"]["prompt_tokens"] < MIN_CONTEXT < long["meta_info"]["prompt_tokens"]
    # per-token step rows (sglang_sparse.psa.stats; column 0: 1 = a sparse step): the long request decoded sparsely
    # in the steps the short one decoded densely
    assert [row[0] for row in long["meta_info"]["sparse_psa_steps"][1:3]] == [1, 1]
    assert all(row[0] == 0 for row in short["meta_info"]["sparse_psa_steps"])
    assert short["text"] == ref["text"]
    assert [t[0] for t in short["meta_info"]["output_token_logprobs"]] == \
        [t[0] for t in ref["meta_info"]["output_token_logprobs"]]


@pytest.fixture(scope="module")
def sketch_server(default_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("psa_sketch") / "server.log"
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        handle = start_cpu_server(default_model, log, mode="psa",
                                  sparse_config=f'{{"min_context": {MIN_CONTEXT}, "runner": "kernel", '
                                                f'"dense_above": 1.0, "estimator": "sketch"}}',
                                  extra_args=("--max-running-requests", "4"))
    finally:
        os.environ.pop("TRITON_INTERPRET", None) if saved is None else os.environ.__setitem__("TRITON_INTERPRET", saved)
    try:
        yield handle
    finally:
        handle.stop()


def test_sketch_estimator_decodes_sparsely_through_the_server(sketch_server, cpu_server):
    """The int4 key sketch is written at the sparse steps (rebuilt from position 0 at the first), ranks the blocks and
    stops the reads; the server's reply keeps the planted number and its report adds up."""
    r = chat(sketch_server, _kernel_prompt(), 2, custom_params={"sparse": {"epsilon": 0.9}})
    rep = r["metadata"]["sparse"]
    assert rep["sparse_decode_steps"] == 1
    assert 0 < rep["blocks_read"] < rep["blocks_total"] and 0.5 < rep["kept_mass"] <= 1.0 + 1e-6
    d = chat(cpu_server, _kernel_prompt(), 2)
    assert r["choices"][0]["message"]["content"] == d["choices"][0]["message"]["content"]
    stats = sketch_server.server_info()["internal_states"][0]["sparse"]["stats"]
    assert stats["meta_rebuilds"] >= 1 and stats["meta_row_shortfalls"] == 0
