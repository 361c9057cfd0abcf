"""Contracts of the long-context testbed: the model builder's 32k profile (YaRN in config.json, served by a
plain ``--model-path``), the ``long`` presets' shapes, and the CI form of every long task kind played through
real CPU servers (``off`` and ``samkv``'s documents API) into the headline JSON."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench import report_long, tasks, tasks_long
from sglang_sparse.config import SamKVConfig


def _build(default_model, out, context=32768):
    return subprocess.run([sys.executable, "-m", "sglang_sparse.tools.build_model", "--context", str(context),
                           "--base", str(default_model), "--out", str(out)], capture_output=True, text=True,
                          timeout=120)


@pytest.fixture(scope="module")
def testbed_model(default_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("testbed") / "SmolLM2-135M-Instruct-32k"
    proc = _build(default_model, out)
    assert proc.returncode == 0, proc.stderr
    return out


def test_context_profile_carries_yarn_in_config(testbed_model):
    cfg = json.loads((testbed_model / "config.json").read_text())
    assert cfg["max_position_embeddings"] == 32768
    assert cfg["rope_parameters"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192,
                                      "rope_theta": 100000.0}
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(testbed_model)
    assert hf.rope_parameters["rope_type"] == "yarn" and hf.max_position_embeddings == 32768
    assert json.loads((testbed_model / "tokenizer_config.json").read_text())["model_max_length"] == 32768


def test_context_profile_second_build_is_a_noop(default_model, testbed_model):
    proc = _build(default_model, testbed_model)
    assert proc.returncode == 0 and "nothing to do" in proc.stdout


@pytest.mark.parametrize("bad", ["5000", "8000", "131072"])
def test_context_out_of_range_is_refused(bad):
    proc = subprocess.run([sys.executable, "-m", "sglang_sparse.tools.build_model", "--context", bad],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--context" in proc.stderr and "out of range" in proc.stderr


def test_long_preset_scores_150_turns_per_position_at_real_lengths():
    suite = tasks.generate("long")
    per_pos = {p: sum(len(t.turns) for t in suite if t.position == p) for p in tasks.POSITIONS}
    assert per_pos == {"begin": 150, "middle": 150, "end": 150}
    chat = [t for t in suite if t.kind == "chat3"]
    assert chat and all(len(t.turns) == 3 and t.turns[2].answers == t.turns[0].answers for t in chat)
    assert all(1536 <= s <= 8192 for t in chat for s in t.meta["turn_tokens"])
    assert {t.meta["tokens"] for t in suite if t.kind == "needle_depth"} == {7680, 15872, 30720}
    rag = [t for t in suite if t.kind == "rag"]
    assert {t.meta["docs"] for t in rag} == {4, 8, 16}
    for t in rag:
        assert all(512 <= n <= 4096 for n in t.meta["doc_tokens"]) and sum(t.meta["doc_tokens"]) <= 28000
        assert len(t.meta["documents"]) == t.meta["docs"] and t.meta["question"].startswith("Question:")
        # the inline prompt holds every document and the question, as a stock client sends it
        assert all(doc in t.turns[0].user for doc in t.meta["documents"])


def test_needle_depth_places_the_fact_at_its_depth():
    for pos, depth in tasks_long.DEPTHS.items():
        t = tasks_long.make_needle_depth(pos, 4000, seed=3)
        text = t.turns[0].user
        at = text.index(f"secret number is {t.turns[0].answers[0]}")
        assert abs(at / len(text) - depth) < 0.12, (pos, at / len(text))
        assert text.rstrip().endswith(tasks.TRAILER) and "Question:" in text[int(0.9 * len(text)):]


def test_long_cpu_kinds_through_real_servers_into_the_headline_json(testbed_model, tmp_path):
    """The 32k profile serves on CPU (context 32768 reported by /v1/models); every long kind is played through
    ``off`` and through ``samkv`` (rag via the documents API) and bench.report_long computes the headline."""
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "bench.run_harness", "--preset", "long_cpu", "--modes", "off,samkv",
                           "--device", "cpu", "--model", str(testbed_model), "--out", str(out), "--parallel",
                           "--concurrency", "2", "--port", "32650"], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for mode in ("off", "samkv"):
        raw = json.loads((out / "raw" / f"{mode}.json").read_text())
        assert raw["server"]["max_model_len"] == 32768
        assert {t["kind"] for t in raw["tasks"]} == {"chat3", "needle_depth", "rag"}
        assert not any(t["error"] for t in raw["tasks"])
    samkv = json.loads((out / "raw" / "samkv.json").read_text())
    rag_turns = [x for t in samkv["tasks"] if t["kind"] == "rag" for x in t["turns"]]
    assert rag_turns and all(x["documents_api"] and x["sparse"]["mode"] == "samkv" for x in rag_turns)
    fid = report_long.fidelity_long(out)
    m = fid["modes"]["samkv"]
    assert m["scored_turns"] == 15 and m["documents_api_turns"] == 3
    assert set(m["accuracy_ratio_by_position"]) == set(tasks.POSITIONS)
    assert set(m["accuracy_ratio_by_length"]) == {"8k", "16k", "32k"}
    assert all(isinstance(m["paired_ci95_by_position"][p], list) for p in tasks.POSITIONS)
    assert 0.0 <= m["engaged_fraction"] <= 1.0 and 0.0 <= m["output_agreement"] <= 1.0
    assert set(fid["dense_accuracy_by_position"]) == set(tasks.POSITIONS)
    # the config the samkv server reported rides along (bench.mode_settings labels rows not at today's defaults)
    assert fid["mode_configs"]["samkv"]["block_size"] == SamKVConfig().block_size
