"""Shared fixtures: one real CPU server for the whole test run, GPU-test skipping."""

from __future__ import annotations

import os

import pytest

from tests.serverproc import DEFAULT_MODEL, start_cpu_server

SERVER_READY_TIMEOUT_S = float(os.environ.get("SPARSE_TEST_SERVER_TIMEOUT", "480"))

# SGLang's crash diagnostics off for the in-process `sgl.Engine` tests: an engine's shutdown ends its scheduler
# first, which SGLang reads as a crashed child and answers with a 5 s sleep before py-spy / CUDA core dumps. Servers
# started through bench.server get the same default from its launcher (Server.environment).
os.environ.setdefault("SGLANG_PYSPY_DUMP_BEFORE_CRASH", "0")
os.environ.setdefault("SGLANG_CUDA_COREDUMP_BEFORE_CRASH", "0")


def _has_cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


# The test files that take longest on the 2-core CPU box (mostly the ones that start their own servers), longest
# first. The test command runs two pytest-xdist workers that take whole files in collection order, so these go first:
# a long file started last would leave the other worker idle at the end. Only the order changes, never what runs.
SLOW_FIRST = (  # per-file times from the test command's --durations on the 2-core box, longest first
    "test_psa_kernel_server.py", "test_psa_sketch_server.py", "test_working_set_admission_server.py",
    "test_server_pinning.py", "test_decode_profile.py", "test_host_tier_server.py", "test_samkv_server.py",
    "test_loopserve_server.py", "test_testbed_long.py", "flashinfer_ext/test_psa_decode.py",
    "test_real_kernel_headlines.py", "test_soak_short.py", "test_faults_short.py", "flashinfer_ext/test_psa_smollm2.py",
    "test_bench_harness.py", "test_load_long.py", "test_working_set_admission_loopserve_server.py",
    "test_loopserve_chunked.py", "test_samkv_graph.py", "test_dormant_server.py", "test_samkv_recompute.py",
    "test_host_tier_lines_server.py", "test_psa_server.py", "test_host_tier_concurrency_bench.py",
    "test_lastwindow_server.py",
)


def _slow_rank(item) -> int:
    path = item.nodeid.split("::", 1)[0]
    for i, name in enumerate(SLOW_FIRST):
        if path == "tests/" + name:
            return i
    return len(SLOW_FIRST)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_slow_rank)  # stable: tests keep their order within a file and among the other files
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (gpu marker); none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_configure(config):
    """A SIGTERM (``timeout``, a CI cancel) ends the run like Ctrl-C: pytest tears the fixtures down, so every
    server a fixture started is stopped by its process group instead of outliving the run."""
    import signal

    def _interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _interrupt)


def pytest_unconfigure(config):
    """SGLang's engine shutdown (an atexit handler of the in-process ``sgl.Engine`` tests) logs after pytest has
    closed its output streams; the logging module would print a "Logging error ... closed file" traceback after
    the summary that reads like a failure. Those late records are dropped instead."""
    import logging

    logging.raiseExceptions = False


@pytest.fixture(scope="session")
def default_model():
    if not (DEFAULT_MODEL / "config.json").is_file():
        pytest.fail(f"default model missing at {DEFAULT_MODEL}: run "
                    "`python -m sglang_sparse.tools.build_model` (the README's setup command does)")
    return DEFAULT_MODEL


@pytest.fixture(scope="session")
def cpu_server(default_model, tmp_path_factory):
    """One `--sparse off` CPU server for the whole run; always stopped by its process group."""
    if _has_cuda():
        pytest.skip("CPU server tests run on the CPU machine (the GPU script covers the GPU server)")
    log = tmp_path_factory.mktemp("server") / "server.log"
    handle = start_cpu_server(default_model, log, mode="off", timeout_s=SERVER_READY_TIMEOUT_S)
    try:
        print(f"\n[cpu_server] ready in {handle.startup_s:.1f}s on {handle.url} (pid {handle.pid}, log {log})")
        yield handle
    finally:
        handle.stop()
