"""Contract (GPU): `--sparse loopserve` at its default prefill (dense, lines from the prompt's last chunk, selected
after the forward for all layers at once) through stock SGLang's FlashInfer backend on CUDA with the Triton kernels:
an engaged prompt (chunked prefill) yields `--sparse off`'s first token, only its last chunk's lines are counted,
and the decode after it runs sparse over fewer tokens than dense."""

from __future__ import annotations

import pytest

from tests.serverproc import chat
from tests.test_gpu_loopserve_server import ARGS as EAGER_ARGS, off_and_sparse
from tests.test_gpu_psa_server import _long_prompt

pytestmark = [pytest.mark.gpu, pytest.mark.server]

LAYERS, KV_HEADS = 30, 3  # SmolLM2-135M
MIN_CONTEXT, CHUNK = 512, 256


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    with off_and_sparse(tmp_path_factory.mktemp("gpu_loopserve_dense"), f'{{"min_context": {MIN_CONTEXT}}}',
                        args=EAGER_ARGS + ["--chunked-prefill-size", str(CHUNK)]) as pair:
        yield pair


def test_gpu_default_dense_prefill_first_token_is_offs_and_only_the_last_chunk_selects(servers):
    dense, sparse = servers
    content = "Dense prefill on the GPU. " + _long_prompt()
    one = chat(sparse, content, 1)
    n = one["usage"]["prompt_tokens"]
    assert n > 2 * CHUNK and n > MIN_CONTEXT
    assert one["choices"][0]["message"]["content"] == chat(dense, content, 1)["choices"][0]["message"]["content"]
    rep = one["metadata"]["sparse"]
    assert rep["lines_total"] == 2 * LAYERS * KV_HEADS * n  # one selection per layer, over all n keys
    assert rep["vertical_lines"] > 0 and 0 < rep["line_fraction"] < 1.0
    more = chat(sparse, content, 8, ignore_eos=True, custom_params={"sparse": {"budget": 64}})["metadata"]["sparse"]
    assert more["sparse_decode_steps"] == 7 and 0 < more["decode_tokens_read"] < more["decode_tokens_total"]
