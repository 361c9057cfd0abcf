"""Contract (CPU server, issue #6 item 1): with ``host_tier_gb > 0`` a radix node evicted from the KV pool by
other requests is saved to the host tier and, when its prompt comes back, loaded instead of recomputed:
the greedy reply is identical, SGLang counts the prompt as cached, and /metrics shows the tokens were
loaded from the host. SGLang's idle KV-leak check stays silent (the scheduler would abort on a leak)."""

from __future__ import annotations

import os
import time

import pytest
import requests
from pydoc_data.topics import topics

from tests.serverproc import sparse_metrics, sparse_metrics_when, start_cpu_server

pytestmark = pytest.mark.server

MAX_TOTAL = 1600  # KV pool: room for two ~700-token prompts, so the third evicts the least recently used


# name: (mode, --sparse-config, extra server args, environment, page size)
CONFIGS = {
    # psa decodes the prompt sparsely (above min_context) with its CPU reference runner
    "psa": ("psa", '{"min_context": 256, "host_tier_gb": 0.1, "gpu_cache_mb": 8, "dense_above": 1.0}', (), {}, 1),
    # loopserve's radix hooks (line sets on nodes) run beside the tier
    "loopserve": ("loopserve", '{"host_tier_gb": 0.1, "gpu_cache_mb": 8}', (), {}, 1),
}
if os.environ.get("SPARSE_HOST_TIER_KERNEL_TEST") == "1":
    # opt-in (about 20 minutes on 2 CPU cores): the GPU runner's code (page = block 16, block metadata
    # recomputed from the reloaded keys by rebuild_page_meta, Triton PSA kernels) under the interpreter,
    # over SGLang's paged allocator
    CONFIGS["psa_kernel_page16"] = ("psa", '{"min_context": 256, "host_tier_gb": 0.1, "gpu_cache_mb": 8, '
                                    '"runner": "kernel", "dense_above": 1.0}', ("--page-size", "16", "--max-running-requests", "4"),
                                    {"TRITON_INTERPRET": "1"}, 16)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tier_server(request, default_model, tmp_path_factory):
    mode, cfg, extra, env, page = CONFIGS[request.param]
    log = tmp_path_factory.mktemp(f"host_tier_{request.param}") / "server.log"
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        handle = start_cpu_server(default_model, log, mode=mode, sparse_config=cfg,
                                  extra_args=("--enable-metrics", "--max-total-tokens", str(MAX_TOTAL), *extra))
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    try:
        yield handle, log, page
    finally:
        handle.stop()


def _text(topic: str) -> str:
    return f"Read this text.\n\n{topics[topic][:2600]}\n\nSummarise the text in one sentence."


def _generate(server, text: str) -> dict:
    r = requests.post(server.url + "/generate", timeout=600, json={
        "text": text, "sampling_params": {"max_new_tokens": 12, "temperature": 0}})
    r.raise_for_status()
    return r.json()


def _metrics(server) -> dict[str, float]:
    return sparse_metrics(server, "sglang_sparse:host_tier_")


def _metrics_when(server, key, pred, timeout_s=30.0):
    return sparse_metrics_when(server, "sglang_sparse:host_tier_", key, pred, timeout_s)


def test_evicted_prompt_is_loaded_from_host_not_recomputed(tier_server):
    server, log, page = tier_server
    run_evict_reload(server, log, page_size=page)


def run_evict_reload(server, log, page_size: int) -> None:
    """The contract above on a server with a ``MAX_TOTAL``-token KV pool (shared with the GPU test)."""
    a, b, c = _text("assignment"), _text("import"), _text("try")
    first = _generate(server, a)
    n = first["meta_info"]["prompt_tokens"]
    assert 600 < n < MAX_TOTAL // 2, n
    second = _generate(server, a)  # a device radix hit: the same computation a reload must reproduce
    aligned = (n - 1) // page_size * page_size  # SGLang matches whole pages, at most all tokens but the last
    assert second["meta_info"]["cached_tokens"] >= aligned
    m0 = _metrics(server)
    _generate(server, b)
    _generate(server, c)  # no room for three: A, the least recently used, is evicted to the host
    m1 = _metrics_when(server, "sglang_sparse:host_tier_saved_tokens_total",
                       lambda v: v >= m0.get("sglang_sparse:host_tier_saved_tokens_total", 0.0) + aligned - 64)
    assert m1["sglang_sparse:host_tier_saved_tokens_total"] >= m0.get(
        "sglang_sparse:host_tier_saved_tokens_total", 0.0) + aligned - 64
    assert m1["sglang_sparse:host_tier_host_nodes"] >= 1 and m1["sglang_sparse:host_tier_host_bytes"] > 0
    loaded0 = m1.get("sglang_sparse:host_tier_loaded_tokens_total", 0.0)

    third = _generate(server, a)
    # SGLang counts the reloaded prefix as cached: only the last token(s) were prefilled
    assert third["meta_info"]["cached_tokens"] >= aligned
    assert third["text"] == second["text"]
    if page_size == 1:  # CPU torch_native: also equal to the first (full-prefill) reply. On the GPU a full
        assert third["text"] == first["text"]  # prefill and a prefix hit differ in FlashInfer's numerics (stock)
    m2 = _metrics_when(server, "sglang_sparse:host_tier_loaded_tokens_total", lambda v: v > loaded0)
    # and those tokens came from the host tier (not from the device tree: A had been evicted)
    assert m2["sglang_sparse:host_tier_loaded_tokens_total"] - loaded0 >= aligned - 64
    assert m2["sglang_sparse:host_tier_loads_total"] >= 1
    assert m2.get("sglang_sparse:host_tier_failed_loads_total", 0.0) == 0
    assert m2["sglang_sparse:host_tier_gathered_gbps"] > 0

    info = requests.get(server.url + "/server_info", timeout=30).json()["internal_states"][0]["sparse"]
    ht = info["host_tier"]  # the scheduler's own counters (/server_info), same story as /metrics
    assert ht["loaded_tokens"] >= aligned - 64 and ht["failed_loads"] == 0 and ht["host_nodes"] >= 1
    assert ht["gather_path"] == ("torch_staging" if info["attention_backend"].endswith("TorchNativeAttnBackend")
                                 else ht["gather_path"])

    time.sleep(1)  # idle: SGLang's scheduler runs its KV leak check as soon as it is idle (it raises and aborts on a leak)
    assert requests.get(server.url + "/health", timeout=30).status_code == 200
    text = log.read_text(errors="replace").lower()
    assert "leak" not in text and "traceback" not in text
