"""A Llama-3.1-8B-shaped model folder for TTFT runs with ``--load-format dummy`` (generated weights).

The 135M model's dense prefill of 8k tokens takes ~57 ms on an H100, so fixed orchestration costs dominate
its TTFT ratio; an 8B-shaped model shows the ratio at a realistic compute cost. No downloads: the folder
holds the small real model's tokenizer files (vocab 49152) and an 8B-shaped ``config.json`` (hidden 4096,
32 layers, 32 query / 8 KV heads of 128, MLP 14336, untied embeddings, ~7.5 B parameters, ~15 GB bf16),
with plain RoPE (``rope_theta`` 500000, no llama3 scaling: SamKV re-rotates keys with plain NeoX RoPE)
and a 32k context (8 documents of ~2k tokens fit). SGLang fills the weights itself (``--load-format dummy``): every answer is noise, so
only latency figures of this model mean anything, and they are labelled "dummy weights" wherever reported.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

LLAMA_8B_SHAPE = {
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 32768, "tie_word_embeddings": False,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
}
LABEL = "Llama-3.1-8B shape (32 layers, hidden 4096, GQA 32/8), DUMMY weights, SmolLM2 tokenizer"
SKIP = (".safetensors", ".bin", ".pt", ".pth")


def make_dummy_llama8b(tokenizer_model: str | Path, out_dir: str | Path) -> Path:
    """Write the folder (idempotent): tokenizer / template files of ``tokenizer_model`` + the 8B config."""
    src, out = Path(tokenizer_model), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name != "config.json" and not f.name.endswith(SKIP) and f.name != "sglang_sparse_build.json":
            shutil.copyfile(f, out / f.name)
    cfg = json.loads((src / "config.json").read_text())
    if cfg.get("vocab_size") != 49152:
        raise ValueError(f"{src}: vocab_size {cfg.get('vocab_size')} (expected SmolLM2's 49152)")
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_")}
    cfg.update(LLAMA_8B_SHAPE, architectures=["LlamaForCausalLM"], model_type="llama",
               sglang_sparse_note=LABEL)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


def parameter_count(cfg: dict) -> int:
    h, i, layers, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * i + 2 * h
    return layers * per_layer + v * h * (1 if cfg.get("tie_word_embeddings") else 2) + h
