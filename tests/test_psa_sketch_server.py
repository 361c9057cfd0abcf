"""Contract (CPU): `--sparse psa` with `estimator: sketch` (the int4 key sketch ranks the blocks and estimates the
unread mass), on either schedule (the progressive stop test, or the sketch's one-pass selection), decodes sparsely through the stock server on a ~4.4k-token prompt with a number hidden in real text,
reads well under the blocks a dense decode reads, and replies token for token as `--sparse off` does."""

from __future__ import annotations

import pytest
from pydoc_data.topics import topics

from tests.serverproc import chat, start_cpu_server

pytestmark = pytest.mark.server


@pytest.fixture(scope="module", params=["progressive", "select"])
def sketch_server(request, default_model, tmp_path_factory):
    log = tmp_path_factory.mktemp(f"psa_sketch_{request.param}") / "server.log"
    handle = start_cpu_server(default_model, log, mode="psa",
                              sparse_config='{"min_context": 1024, "estimator": "sketch", "dense_above": 1.0, '
                                            f'"schedule": "{request.param}"}}')
    try:
        yield handle
    finally:
        handle.stop()


def _needle_prompt() -> str:
    """About 4.4k tokens of the Python reference with one number at ~60 % depth, question last."""
    text = "\n\n".join(topics[k] for k in ("assignment", "atom-literals", "attribute-access", "augassign",
                                           "binary", "bitwise", "bltin-code-objects", "bltin-ellipsis-object"))[:19000]
    cut = int(len(text) * 0.6)
    return (f"Read this text.\n\n{text[:cut]}\n\nThe secret number is 73914.\n\n{text[cut:]}\n\n"
            "What is the secret number? Answer with the number only.")


def test_sketch_keeps_the_dense_reply_on_a_long_prompt(sketch_server, cpu_server):
    prompt = _needle_prompt()
    sparse = chat(sketch_server, prompt, 12)
    dense = chat(cpu_server, prompt, 12)
    rep = sparse["metadata"]["sparse"]
    assert sparse["usage"]["prompt_tokens"] > 4000
    assert rep["sparse_decode_steps"] == sparse["usage"]["completion_tokens"] - 1 > 0
    assert rep["blocks_read"] < 0.7 * rep["blocks_total"], rep
    assert sparse["choices"][0]["message"]["content"] == dense["choices"][0]["message"]["content"]
