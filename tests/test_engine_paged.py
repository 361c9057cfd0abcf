"""Contract: `sgl.Engine(sparse=..., sparse_config=...)` runs in-process with the plugin's
fields, and the CPU runtime's pure-torch paged allocator (page size 16) serves the same greedy
answer as the token allocator and shares prefixes through the radix cache.

The engine runs in a child Python process (:data:`ENGINE_SCRIPT`), in-process there: SGLang's
``Engine.shutdown`` kills every child process of the process that holds the engine
(``kill_process_tree(os.getpid(), include_parent=False)``), which inside the test process would also
stop the servers other tests of the same run started."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.serverproc import server_env
from tests.test_server_e2e import GOLDEN, PROMPT

pytestmark = pytest.mark.server

ENGINE_SCRIPT = r"""
import json, sys
import sglang as sgl
from transformers import AutoTokenizer

model, prompt_json = sys.argv[1], sys.argv[2]
eng = sgl.Engine(model_path=model, device="cpu", dtype="bfloat16", max_total_tokens=8192,
                 page_size=16, sparse="off", sparse_config="{}", log_level="error")
try:
    tok = AutoTokenizer.from_pretrained(model)
    prompt = tok.apply_chat_template(json.loads(prompt_json), tokenize=False, add_generation_prompt=True)
    params = {"temperature": 0, "max_new_tokens": 24}
    first, second = eng.generate(prompt, params), eng.generate(prompt, params)
    out = {"sparse": eng.server_args.sparse, "sparse_config": eng.server_args.sparse_config,
           "page_size": eng.server_args.page_size, "first": first["text"], "second": second["text"],
           "prompt_tokens": second["meta_info"]["prompt_tokens"], "cached_tokens": second["meta_info"]["cached_tokens"]}
finally:
    eng.shutdown()
print("ENGINE_RESULT " + json.dumps(out), flush=True)
"""


@pytest.fixture(scope="module")
def engine_run(default_model):
    """What the child process's engine reported: its server args and two greedy generations of PROMPT."""
    p = subprocess.run([sys.executable, "-c", ENGINE_SCRIPT, str(default_model), json.dumps(PROMPT)],
                       capture_output=True, text=True, timeout=600, env=server_env())
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("ENGINE_RESULT ")]
    assert p.returncode == 0 and lines, f"engine child exited {p.returncode}:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    return json.loads(lines[-1].split(" ", 1)[1])


def test_engine_takes_sparse_fields(engine_run):
    assert engine_run["sparse"] == "off" and engine_run["sparse_config"] == "{}"
    assert engine_run["page_size"] == 16


def test_engine_with_page_size_16_gives_the_fixed_greedy_answer_and_reuses_prefix(engine_run):
    assert engine_run["first"].strip() == GOLDEN
    assert engine_run["second"] == engine_run["first"]
    # page-aligned prefix of the identical prompt comes from the radix cache
    n = engine_run["prompt_tokens"]
    assert engine_run["cached_tokens"] >= (n - 1) // 16 * 16 > 0
