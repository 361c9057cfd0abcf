"""Contract: the model builder produced a loadable HF folder with a chat template, and a second
run is a no-op (idempotent)."""

from __future__ import annotations

import json
import subprocess
import sys

from sglang_sparse.tools import build_model


def test_default_model_folder_is_complete_with_chat_template(default_model):
    assert build_model._is_complete(default_model, json.loads((default_model / build_model.MANIFEST).read_text())["dtype"])
    tok_cfg = json.loads((default_model / "tokenizer_config.json").read_text())
    template = tok_cfg.get("chat_template") or (default_model / "chat_template.jinja").read_text()
    assert "<|im_start|>" in template
    cfg = json.loads((default_model / "config.json").read_text())
    assert cfg["num_attention_heads"] == 9 and cfg["num_key_value_heads"] == 3 and cfg["num_hidden_layers"] == 30


def test_second_build_is_a_noop(default_model):
    dtype = json.loads((default_model / build_model.MANIFEST).read_text())["dtype"]
    proc = subprocess.run([sys.executable, "-m", "sglang_sparse.tools.build_model", "--out", str(default_model),
                           "--dtype", dtype], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "nothing to do" in proc.stdout


def test_bad_dtype_is_refused():
    proc = subprocess.run([sys.executable, "-m", "sglang_sparse.tools.build_model", "--dtype", "int8"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "invalid choice: 'int8'" in proc.stderr
