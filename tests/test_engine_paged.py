"""Contract: `sgl.Engine(sparse=..., sparse_config=...)` runs in-process with the plugin's
fields, and the CPU runtime's pure-torch paged allocator (page size 16) serves the same greedy
answer as the token allocator and shares prefixes through the radix cache."""

from __future__ import annotations

import pytest

from tests.test_server_e2e import GOLDEN, PROMPT

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def engine(default_model):
    import sglang as sgl

    eng = sgl.Engine(model_path=str(default_model), device="cpu", dtype="bfloat16", max_total_tokens=8192,
                     page_size=16, sparse="off", sparse_config="{}", log_level="error")
    try:
        yield eng
    finally:
        eng.shutdown()


def test_engine_takes_sparse_fields(engine):
    assert engine.server_args.sparse == "off" and engine.server_args.sparse_config == "{}"
    assert engine.server_args.page_size == 16


def test_engine_with_page_size_16_gives_the_fixed_greedy_answer_and_reuses_prefix(engine, default_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_model))
    prompt = tok.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    params = {"temperature": 0, "max_new_tokens": 24}
    first = engine.generate(prompt, params)
    assert first["text"].strip() == GOLDEN
    second = engine.generate(prompt, params)
    assert second["text"] == first["text"]
    # page-aligned prefix of the identical prompt comes from the radix cache
    n = second["meta_info"]["prompt_tokens"]
    assert second["meta_info"]["cached_tokens"] >= (n - 1) // 16 * 16 > 0
