"""Contract (GPU): under ``--enable-deterministic-inference`` psa's ``stock_rows`` 'auto' is 'exact': a request that
psa never engages decodes exactly as `--sparse off` does (same tokens, bitwise-equal logprobs) while it shares its
decode steps with an engaged request, replayed graphs of the PSA path included (batch sizes up to
``--cuda-graph-max-bs`` 4). With the PSA kernel at epsilon 1 for such rows ('kernel') its logprobs round differently
and about a quarter of the `long` preset's never-engaged replies changed text. The CPU form of this contract runs in
``tests/test_psa_kernel_server.py`` (Triton interpreter, ``stock_rows`` 'exact')."""

from __future__ import annotations

import time

import pytest

from tests.test_gpu_deterministic_mixed_decode import _background, _logprobs, _prompt
from tests.serverproc import chat
from tests.test_gpu_loopserve_server import off_and_sparse

pytestmark = [pytest.mark.gpu, pytest.mark.server]

MIN_CONTEXT = 4096
ARGS = ["--attention-backend", "flashinfer", "--mem-fraction-static", "0.2", "--cuda-graph-max-bs", "4",
        "--enable-deterministic-inference"]
PSA_CONFIG = (f'{{"min_context": {MIN_CONTEXT}, "estimator": "sketch", "schedule": "select", "calib_slack": 4, '
              '"dense_above": 1.0}')


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    with off_and_sparse(tmp_path_factory.mktemp("gpu_psa_det_mixed"), PSA_CONFIG, args=ARGS, mode="psa") as pair:
        yield pair


def test_gpu_deterministic_psa_stock_rows_of_mixed_batches_equal_off(servers):
    dense, sparse = servers
    short = _prompt(2300, seed=1)  # ~3k tokens: below MIN_CONTEXT, never engaged
    ref = chat(dense, short, 48, ignore_eos=True, logprobs=True)
    assert ref["usage"]["prompt_tokens"] < MIN_CONTEXT
    threads = _background(sparse, [_prompt(4500, seed=2)], 1000)  # ~5.7k tokens: engaged
    time.sleep(1.0)  # the engaged request is decoding when the stock one joins its batches
    mixed = chat(sparse, short, 48, ignore_eos=True, logprobs=True)
    overlapped = threads[0].is_alive()
    threads[0].join()
    assert overlapped
    assert mixed["metadata"]["sparse"].get("sparse_decode_steps", 0) == 0
    assert sparse.server_info()["internal_states"][0]["sparse"]["stats"]["sparse_decode_steps"] > 0
    assert mixed["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"]
    assert _logprobs(mixed) == _logprobs(ref)
