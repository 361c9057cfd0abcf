"""Launch shapes of LoopServe's sparse prefill kernel on the 32k testbed's real attention (GPU timing; CPU smoke).

    python bench/vs_prefill_sweep.py --testbed-model /tmp/models/SmolLM2-135M-Instruct-32k --out DIR
    python bench/vs_prefill_sweep.py --tokens 512 --layers 3 --out DIR      # CPU (Triton interpreter), no timing

Captures q/k/v of the testbed model on its needle prompt (:mod:`bench.real_capture`), selects each layer's lines
at the served ``alpha`` exactly as a server layer does (:func:`bench.loopserve_prefill_bench.sparse_prefill`'s
estimate and select), then times :func:`flashinfer_ext.loopserve.vs_prefill.vs_prefill` alone over a grid of
``block_m`` x ``block_n`` x ``num_warps`` x ``num_stages``, beside FlashInfer's dense causal prefill of the same
q/k/v. Every configuration's output is compared with the default's (max abs difference: only the fp32 summation
order may differ). Writes ``vs_prefill_sweep.{json,md}`` with the command, device, versions and shapes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import real_capture  # noqa: E402
from bench.loopserve_prefill_bench import SERVED_ALPHA, dense_fn, pool_of, select_lines  # noqa: E402
from bench.timing import timed  # noqa: E402
from flashinfer_ext.loopserve.vs_prefill import vs_prefill  # noqa: E402

DEFAULT = dict(block_m=64, block_n=None, num_warps=None, num_stages=None)  # the kernel's own (launch_shape)
GRID = dict(block_m=(64, 128), block_n=(32, 64, 128), num_warps=(4, 8), num_stages=(1, 2, 3))


def configs(smoke: bool) -> list[dict]:
    if smoke:
        return [DEFAULT, dict(block_m=128, block_n=32, num_warps=None, num_stages=None)]
    return [DEFAULT] + [dict(zip(GRID, c)) for c in itertools.product(*GRID.values())]


def run(model_dir, tokens: int, layers, dev: str, iters: int) -> tuple[list, dict]:
    rows, info_out = [], {}
    for _slot, cap, info in real_capture.testbed_captures(model_dir, {"real": tokens}, tuple(layers), dev):
        info_out = info
        for layer in layers:
            q, k, v = (x.bfloat16().to(dev).contiguous() for x in cap[layer])
            t = q.shape[0]
            sm_scale = q.shape[-1] ** -0.5
            k_buf, v_buf, slots = pool_of(k, v, dev)
            sel = select_lines(q, k_buf, slots, sm_scale, alpha=SERVED_ALPHA)
            out = torch.empty_like(q)
            dense = dense_fn(q, k, v, sm_scale)
            t_dense = timed(dense, iters=iters, warmup=2) if dev == "cuda" else float("nan")
            ref = None
            for cfg in configs(dev != "cuda"):
                def call(cfg=cfg):
                    return vs_prefill(q, k_buf, v_buf, slots, prefix_len=0, seq_len=t, v_idx=sel.v_idx,
                                      v_cnt=sel.v_cnt, s_idx=sel.s_idx, s_cnt=sel.s_cnt, sm_scale=sm_scale, out=out,
                                      **cfg)[0]
                row = dict(layer=layer, ctx=t, **cfg)
                try:
                    o = call().float().clone()
                    ref = o if ref is None else ref
                    row["max_abs_diff_vs_default"] = float((o - ref).abs().max())
                    row["t_ms"] = timed(call, iters=iters, warmup=2) * 1e3 if dev == "cuda" else float("nan")
                    row["t_dense_ms"] = t_dense * 1e3
                    row["dense_over_sparse"] = t_dense * 1e3 / row["t_ms"]
                except Exception as e:  # a shape the compiler refuses (shared memory): recorded, not fatal
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                print(json.dumps(row), flush=True)
                rows.append(row)
            q = k = v = k_buf = v_buf = None
            if dev == "cuda":
                torch.cuda.empty_cache()
    return rows, info_out


def _name(c: dict) -> str:
    return f"m{c['block_m']} n{c['block_n'] or '-'} w{c['num_warps'] or '-'} s{c['num_stages'] or '-'}"


def summarize(rows: list) -> list[dict]:
    """Per configuration: summed kernel time over the layers, against the default's and dense's."""
    by = {}
    for r in rows:
        if "error" in r or r.get("t_ms") != r.get("t_ms"):  # errors and NaN timings
            continue
        key = _name(r)
        s = by.setdefault(key, dict(config=key, t_ms=0.0, t_dense_ms=0.0, layers=0, max_abs_diff=0.0))
        s["t_ms"] += r["t_ms"]
        s["t_dense_ms"] += r["t_dense_ms"]
        s["layers"] += 1
        s["max_abs_diff"] = max(s["max_abs_diff"], r["max_abs_diff_vs_default"])
    out = sorted(by.values(), key=lambda s: s["t_ms"])
    base = by.get(_name(DEFAULT))
    for s in out:
        s["dense_over_sparse"] = s["t_dense_ms"] / s["t_ms"]
        s["default_over_this"] = base["t_ms"] / s["t_ms"] if base else None
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--testbed-model", type=Path, default=real_capture.TESTBED_MODEL)
    ap.add_argument("--tokens", type=int, default=32000, help="prompt tokens of the capture")
    ap.add_argument("--layers", default="3,15,27")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.time()
    layers = [int(x) for x in a.layers.split(",")]
    rows, info = run(a.testbed_model, a.tokens, layers, dev, a.iters)
    summary = summarize(rows)
    gpu = torch.cuda.get_device_name(0) if dev == "cuda" else "CPU (Triton interpreter; no timing)"
    import platform

    import triton
    try:
        import flashinfer
        fi = getattr(flashinfer, "__version__", None)
    except ImportError:
        fi = None
    versions = (f"torch {torch.__version__}, triton {triton.__version__}, flashinfer {fi}, "
                f"python {platform.python_version()}")
    meta = dict(command="python3 bench/vs_prefill_sweep.py " + " ".join(sys.argv[1:]), gpu=gpu, versions=versions,
                alpha=SERVED_ALPHA, capture=info, wall_s=round(time.time() - t0, 1), grid=GRID, default=DEFAULT)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "vs_prefill_sweep.json").write_text(json.dumps(dict(meta=meta, summary=summary, rows=rows), indent=1))
    md = ["# LoopServe sparse prefill kernel: launch shapes on the testbed's real attention", "",
          f"- command: `{meta['command']}`", f"- device: {gpu}", f"- versions: {meta['versions']}",
          f"- capture: {info.get('prompt_len')} tokens of the 32k testbed model's needle prompt, layers {layers}, "
          f"9/3 heads, d 64, bf16; lines selected at alpha {SERVED_ALPHA} as a server layer selects them",
          "- t = median CUDA-event time of `vs_prefill` alone, summed over the layers; dense = FlashInfer "
          "`single_prefill_with_kv_cache(causal=True)` on the same q/k/v; diff = largest |output - default's output|; "
          "`-` = the kernel's default for this head_dim (`flashinfer_ext.loopserve.vs_prefill.launch_shape`)",
          "", "| config (block_m, block_n, warps, stages) | t ms | dense ms | dense / sparse | default / this | diff |",
          "|---|---|---|---|---|---|"]
    md += [f"| {s['config']} | {s['t_ms']:.2f} | {s['t_dense_ms']:.2f} | {s['dense_over_sparse']:.3f} | "
           f"{(s['default_over_this'] or float('nan')):.2f} | {s['max_abs_diff']:.2e} |" for s in summary]
    errs = [r for r in rows if "error" in r]
    if errs:
        md += ["", f"{len(errs)} (layer, config) runs failed: " + "; ".join(
            f"{_name(r)}: {r['error'][:80]}" for r in errs[:6])]
    (a.out / "vs_prefill_sweep.md").write_text("\n".join(md) + "\n")
    print(json.dumps(summary[:5], indent=1))
    print(f"wrote {a.out}/vs_prefill_sweep.md in {meta['wall_s']:.0f}s")


if __name__ == "__main__":
    main()
