"""Contract (GPU, issue #6 item 1): the CPU host-tier server contract (tests/test_host_tier_server.py) on
CUDA with FlashInfer and page 16: a radix node evicted from a small KV pool is saved to pinned host
memory (CPU-assisted save), loaded back on the prompt's next hit through the fused UVA gather (the
Triton path, not the staging fallback) instead of being recomputed, PSA decodes it sparsely (the
prompt is above min_context; block metadata recomputed from the reloaded keys) with the same greedy
reply as the device-hit run, and SGLang's idle KV-leak check stays silent."""

from __future__ import annotations

import json
import sys

import pytest

from bench.server import Server, ServerSpec
from tests.serverproc import DEFAULT_MODEL, free_port
from tests.test_host_tier_lines_server import MIN_CONTEXT, run_lines_travel
from tests.test_host_tier_server import MAX_TOTAL, run_evict_reload
from tests.test_working_set_admission_server import check_admission_under_pressure

pytestmark = [pytest.mark.gpu, pytest.mark.server]


@pytest.fixture(scope="module")
def gpu_tier_server(tmp_path_factory):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    log = tmp_path_factory.mktemp("gpu_host_tier") / "server.log"
    spec = ServerSpec(python=sys.executable, model=str(DEFAULT_MODEL), device="cuda", port=free_port(), mode="psa",
                      sparse_config='{"min_context": 512, "host_tier_gb": 0.5, "gpu_cache_mb": 16, "dense_above": 1.0}',
                      extra_args=["--attention-backend", "flashinfer", "--page-size", "16", "--enable-metrics",
                                  "--mem-fraction-static", "0.2", "--max-total-tokens", str(MAX_TOTAL),
                                  "--cuda-graph-max-bs", "4"])
    server = Server(spec, log, timeout_s=600).start()
    try:
        yield server, log
    finally:
        server.stop()


def test_gpu_evicted_prompt_is_loaded_from_host_not_recomputed(gpu_tier_server):
    server, log = gpu_tier_server
    text = log.read_text(errors="replace")
    # the fused UVA gather kernel serves the reloads (torch_staging would be the slow fallback)
    assert "gather path triton_uva" in text, [ln for ln in text.splitlines() if "host tier" in ln]
    run_evict_reload(server, log, page_size=16)


def _admission_server(tmp_path_factory, tag: str, mode: str, cfg: dict):
    """A started CUDA server (FlashInfer, page 16, decode graphs up to bs 4, a 6000-token pool) for the admission
    tests, and its log path."""
    log = tmp_path_factory.mktemp(tag) / "server.log"
    spec = ServerSpec(python=sys.executable, model=str(DEFAULT_MODEL), device="cuda", port=free_port(), mode=mode,
                      sparse_config=json.dumps(cfg),
                      extra_args=["--attention-backend", "flashinfer", "--page-size", "16", "--enable-metrics",
                                  "--mem-fraction-static", "0.2", "--max-total-tokens", "6000",
                                  "--cuda-graph-max-bs", "4"])
    return Server(spec, log, timeout_s=600).start(), log


def test_gpu_working_set_admission_holds_requests_on_measured_working_sets(tmp_path_factory):
    """Issue #6 item 3 on CUDA: PSA decode replays CUDA graphs that record each step's read blocks into the
    working-set tracker; the scheduler holds requests back on those measured working sets, all complete."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cfg = {"min_context": 256, "host_tier_gb": 0.5, "gpu_cache_mb": 16, "working_set_window": 4, "dense_above": 1.0}
    server, log = _admission_server(tmp_path_factory, "gpu_ws_admission", "psa", cfg)
    try:
        ws = check_admission_under_pressure(server, log)
    finally:
        server.stop()
    assert ws["tracked_slots"] > 0


def test_gpu_loopserve_working_set_admission_holds_requests_on_measured_working_sets(tmp_path_factory):
    """Issue #6 item 3 under --sparse loopserve on CUDA (FlashInfer, page 16, decode graphs): LoopServe's decode
    records the tokens it attends as (layer, KV head, page) units through the Triton ws_record_tokens kernel, in
    eager steps and inside the replayed steady-step graphs; the scheduler holds requests back on those measured
    working sets, all complete (tests/test_working_set_admission_loopserve_server.py on the CPU)."""
    import torch

    from tests.test_working_set_admission_loopserve_server import CONFIG

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    # 16 MiB at page 16 = 4096 units of (layer, page, KV head): one ~480-token context (30 pages x 30 layers x
    # 3 KV heads = 2700 units) fits, a second only on a measured working set
    cfg = dict(CONFIG, host_tier_gb=0.5, gpu_cache_mb=16)
    server, log = _admission_server(tmp_path_factory, "gpu_ws_admission_loopserve", "loopserve", cfg)
    try:
        ws = check_admission_under_pressure(server, log)
        stats = server.server_info()["internal_states"][0]["sparse"]["stats"]
    finally:
        server.stop()
    print("loopserve stats:", stats)
    assert ws["tracked_slots"] == cfg["working_set_slots"], ws
    assert stats["sparse_decode_rows"] > 0 and stats["graph_decode_steps"] > 0, stats  # eager and replayed steps
    text = log.read_text(errors="replace")
    assert "working-set tracker" in text and "record triton" in text, \
        [ln for ln in text.splitlines() if "working-set" in ln]


def test_gpu_loopserve_lines_travel_with_a_node_evicted_to_the_host(tmp_path_factory):
    """Issue #6 item 1 on CUDA (FlashInfer, page 16, decode graphs): turn 1's LoopServe lines go to the host
    with its evicted radix node and come back with it; turn 2 reuses them (tests/test_host_tier_lines_server.py)."""
    import torch
    from transformers import AutoTokenizer

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    log = tmp_path_factory.mktemp("gpu_host_tier_lines") / "server.log"
    cfg = {"min_context": MIN_CONTEXT, "alpha": 0.97, "host_tier_gb": 0.5, "gpu_cache_mb": 16}
    spec = ServerSpec(python=sys.executable, model=str(DEFAULT_MODEL), device="cuda", port=free_port(),
                      mode="loopserve", sparse_config=json.dumps(cfg),
                      extra_args=["--attention-backend", "flashinfer", "--page-size", "16", "--enable-metrics",
                                  "--mem-fraction-static", "0.2", "--max-total-tokens", str(MAX_TOTAL),
                                  "--cuda-graph-max-bs", "4"])
    server = Server(spec, log, timeout_s=600).start()
    try:
        run_lines_travel(server, log, AutoTokenizer.from_pretrained(str(DEFAULT_MODEL)))
    finally:
        server.stop()
