"""Contract: stock SGLang with the plugin serves the default model on CPU under `--sparse off`
through the OpenAI API (plain and streaming) and the frontend DSL, with the plugin active in
both the main and the scheduler process."""

from __future__ import annotations

import psutil
import pytest
import requests

pytestmark = pytest.mark.server

# Greedy answer of SmolLM2-135M-Instruct (bf16 weights, --dtype bfloat16, torch_native attention, CPU).
PROMPT = [{"role": "user", "content": "What is the capital of France?"}]
GOLDEN = "The capital of France is Paris."


def _openai(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="none", timeout=60, max_retries=0)


def test_chat_completion_gives_the_fixed_greedy_answer(cpu_server):
    r = _openai(cpu_server).chat.completions.create(model="default", messages=PROMPT, max_tokens=24, temperature=0)
    assert r.choices[0].message.content == GOLDEN
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens == 8


def test_streaming_chat_completion_gives_the_same_answer(cpu_server):
    stream = _openai(cpu_server).chat.completions.create(model="default", messages=PROMPT, max_tokens=24,
                                                          temperature=0, stream=True)
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len([p for p in pieces if p]) > 1, "expected several streamed chunks"
    assert "".join(pieces) == GOLDEN


def test_plugin_is_active_in_main_and_scheduler_process(cpu_server):
    info = requests.get(cpu_server.url + "/server_info", timeout=30).json()
    # main process: the flags were parsed by the plugin's ServerArgs and resolved
    assert info["sparse"] == "off" and info["sparse_config"] == "{}"
    # scheduler process: sglang_sparse.runtime_hooks ran there (scheduler_init_hook,
    # attention_backend_hook, internal_state_hook) and the attention backend got the context
    state = info["internal_states"][0]["sparse"]
    assert state["mode"] == "off" and state["config"] == {}
    assert state["attention_backend_mode"] == "off"
    assert state["attention_backend"] == "TorchNativeAttnBackend"
    main = psutil.Process(cpu_server.pid)
    children = {p.pid for p in main.children(recursive=True)}
    assert state["plugin_pid"] != cpu_server.pid and state["plugin_pid"] in children


def test_two_turn_dsl_program_hits_the_radix_cache(cpu_server):
    import sglang as sgl

    @sgl.function
    def two_turns(s):
        s += sgl.system("You are a helpful assistant. Answer briefly.")
        s += sgl.user("My favourite colour is green. Remember it.")
        s += sgl.assistant(sgl.gen("a1", max_tokens=16, temperature=0))
        s += sgl.user("What is my favourite colour?")
        s += sgl.assistant(sgl.gen("a2", max_tokens=16, temperature=0))

    backend = sgl.RuntimeEndpoint(cpu_server.url, chat_template_name="chatml")
    state = two_turns.run(backend=backend)
    first, second = state.get_meta_info("a1"), state.get_meta_info("a2")
    assert state["a1"] and state["a2"]
    # the server reports how many prompt tokens of turn 2 came from the radix cache:
    # at least all of turn 1's prompt must have been reused
    assert second["cached_tokens"] >= first["prompt_tokens"] > 0
    assert second["prompt_tokens"] > second["cached_tokens"]


def test_documents_field_needs_the_samkv_mode(cpu_server):
    """`extra_body.documents` on a server not in `--sparse samkv` is a 400 naming the field, never dropped."""
    for path, extra in (("/v1/chat/completions", {"messages": PROMPT}), ("/v1/completions", {"prompt": "Hi"})):
        r = requests.post(cpu_server.url + path, timeout=120,
                          json={"model": "default", "max_tokens": 2, "documents": ["a document"], **extra})
        assert r.status_code == 400, r.text
        assert "'documents' needs a server started with --sparse samkv (this one runs 'off')" in r.json()["message"]
