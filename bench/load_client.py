"""In-process streaming client of the load benchmark (:mod:`bench.load`, ``--client fast``, the default).

One cell = (input length, max concurrency): ``n`` prompts of exactly ``input_len`` tokens of real prose
(:mod:`bench.corpus`, tokenized with the served model's own tokenizer, sent as token ids so the length is
exact), each asking for exactly ``output_len`` tokens (``ignore_eos``, greedy), streamed through
``/v1/completions`` with at most ``concurrency`` requests in flight (threads; all requests are queued at
once, i.e. request rate inf, like ``sglang.benchmark.serving --max-concurrency``). The OpenAI endpoint is
used rather than ``/generate`` because ``/generate`` streams the whole ``meta_info`` with every chunk,
including the per-token step rows some sparse modes attach, which would charge those modes a
serialization cost a normal client never asks for.

Per request: TTFT = first streamed token - request start; TPOT = (last token - first token) / (tokens - 1);
e2e latency = last token - request start. Per cell: output throughput = completion tokens of all requests /
(last end - first start). Names of the cell figures match ``sglang.benchmark.serving``'s output
(``output_throughput``, ``mean_ttft_ms``, ...), so both clients fill the same table.

Prompts depend only on (seed, input length, concurrency, index), never on the mode, so every mode of a
run serves the same token ids; each prompt of a cell starts with a different corpus paragraph, so no
two requests of a cell share a prefix of more than a few tokens (and :func:`flush_cache` empties the radix
cache before every cell, so no cell reuses another cell's prefill).
"""

from __future__ import annotations

import json
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from bench.conc_stats import percentile
from bench.mode_settings import reported_config


def input_label(n: int) -> str:
    """"4k" for 4096 or 4000, "16k" for 16384, "32k" for 32000 or 32768; plain digits below 1000."""
    if n < 1000:
        return str(n)
    k = n // 1024 if n % 1024 == 0 else round(n / 1000)
    return f"{k}k"


def cell_key(input_len: int, concurrency: int) -> str:
    return f"{input_label(input_len)}_c{concurrency}"


def kv_bytes_per_token(model_dir: str, dtype_bytes: int = 2) -> int:
    """K and V bytes of one token over all layers, from the model's ``config.json``."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", heads) * head_dim * 2 * dtype_bytes


class PromptMaker:
    """Token-exact prose prompts; every corpus paragraph is tokenized once."""

    def __init__(self, model_dir: str):
        from transformers import AutoTokenizer

        from bench import corpus

        tok = AutoTokenizer.from_pretrained(model_dir)
        paras = list(corpus.paragraphs())
        self.paras = [tok.encode(p + "\n\n", add_special_tokens=False) for p in paras]

    def prompt(self, n_tokens: int, rng: random.Random, first: int) -> list[int]:
        ids = list(self.paras[first])
        while len(ids) < n_tokens:
            order = list(range(len(self.paras)))
            rng.shuffle(order)
            for i in order:
                ids += self.paras[i]
                if len(ids) >= n_tokens:
                    break
        return ids[:n_tokens]

    def cell_prompts(self, seed: int, input_len: int, concurrency: int, n: int) -> list[list[int]]:
        rng = random.Random(f"load|{seed}|{input_len}|{concurrency}")
        firsts = rng.sample(range(len(self.paras)), min(n, len(self.paras)))
        firsts += [rng.randrange(len(self.paras)) for _ in range(n - len(firsts))]
        return [self.prompt(input_len, rng, f) for f in firsts]


def iter_sse(response):
    """The ``data:`` payloads (bytes) of a server-sent-event stream, up to ``[DONE]``."""
    for line in response.iter_lines():
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        yield data


def stream_completion(url: str, ids: list[int], max_tokens: int, timeout_s: float) -> dict:
    """One streamed greedy completion of exactly ``max_tokens`` tokens; monotonic timestamps."""
    body = {"model": "default", "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.monotonic()
    first = last = None
    usage = None
    try:
        with requests.post(url + "/v1/completions", json=body, stream=True, timeout=(10, timeout_s)) as r:
            if r.status_code != 200:
                return {"ok": False, "t_start": t0, "error": f"HTTP {r.status_code}: {r.text[:300]}"}
            for data in iter_sse(r):
                now = time.monotonic()
                if first is not None and b'"usage":null' in data.replace(b" ", b""):
                    last = now  # a token chunk after the first: no need to parse it
                    continue
                obj = json.loads(data)
                if obj.get("error"):
                    return {"ok": False, "t_start": t0, "error": str(obj["error"])[:300]}
                if obj.get("usage"):
                    usage = obj["usage"]
                if any(ch.get("text") for ch in obj.get("choices") or []):
                    last = now
                    if first is None:
                        first = now
    except (requests.RequestException, ValueError) as e:
        return {"ok": False, "t_start": t0, "error": f"{type(e).__name__}: {e}"}
    if usage is None or first is None:
        return {"ok": False, "t_start": t0, "error": f"stream ended without {'usage' if usage is None else 'tokens'}"}
    n = int(usage.get("completion_tokens") or 0)
    return {"ok": True, "t_start": t0, "t_first": first, "t_end": last, "completion_tokens": n,
            "prompt_tokens": int(usage.get("prompt_tokens") or 0), "ttft_s": first - t0,
            "tpot_s": (last - first) / (n - 1) if n > 1 else None, "e2e_s": last - t0}


def flush_cache(url: str, timeout_s: float = 60.0) -> bool:
    """Empty the radix cache (waits until the scheduler is idle); False when the server refused."""
    try:
        r = requests.post(url + "/flush_cache", params={"timeout": timeout_s}, timeout=timeout_s + 30)
        return r.status_code == 200
    except requests.RequestException:
        return False


def run_cell(url: str, prompts: list[list[int]], output_len: int, concurrency: int, timeout_s: float) -> dict:
    """All prompts queued at once, at most ``concurrency`` in flight; returns :func:`summarize`'s dict."""
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        futs = [pool.submit(stream_completion, url, p, output_len, timeout_s) for p in prompts]
        results = [f.result() for f in futs]
    return summarize(results, t0, time.monotonic(), output_len)


def summarize(results: list[dict], t0: float, t1: float, output_len: int) -> dict:
    ok = [r for r in results if r.get("ok")]
    ms = lambda xs, q: None if not xs else 1e3 * percentile(xs, q)  # noqa: E731
    mean_ms = lambda xs: None if not xs else 1e3 * statistics.fmean(xs)  # noqa: E731
    ttft = [r["ttft_s"] for r in ok]
    tpot = [r["tpot_s"] for r in ok if r["tpot_s"] is not None]
    end = max([r["t_end"] for r in ok], default=t1)
    dur = max(end - t0, 1e-9)
    out_tok = sum(r["completion_tokens"] for r in ok)
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "duration": dur,
        "output_throughput": out_tok / dur if ok else None,
        "input_throughput": sum(r["prompt_tokens"] for r in ok) / dur if ok else None,
        "request_throughput": len(ok) / dur if ok else None,
        "mean_ttft_ms": mean_ms(ttft), "median_ttft_ms": ms(ttft, 50), "p99_ttft_ms": ms(ttft, 99),
        "mean_tpot_ms": mean_ms(tpot), "median_tpot_ms": ms(tpot, 50), "p99_tpot_ms": ms(tpot, 99),
        "mean_e2e_latency_ms": mean_ms([r["e2e_s"] for r in ok]),
        "mean_output_tokens": out_tok / len(ok) if ok else None,
        "output_tokens_exact": all(r["completion_tokens"] == output_len for r in ok),
        "errors": sorted({r["error"] for r in results if not r.get("ok")})[:3],
        # each request's TTFT in prompt order (None: failed): a one-off stall shows against the median
        "ttft_ms_each": [round(1e3 * r["ttft_s"], 1) if r.get("ok") else None for r in results],
    }


def server_sparse_config(url: str) -> dict | None:
    """The sparse config the server reports in ``/server_info`` (None when absent or unreachable)."""
    try:
        return reported_config(requests.get(url + "/server_info", timeout=30).json())
    except (requests.RequestException, ValueError):
        return None


def server_pool_tokens(url: str) -> int | None:
    """``max_total_num_tokens`` of the server's KV pool from ``/server_info`` (None when absent)."""
    def find(x):
        if isinstance(x, dict):
            if isinstance(x.get("max_total_num_tokens"), int):
                return x["max_total_num_tokens"]
            x = list(x.values())
        if isinstance(x, list):
            for v in x:
                got = find(v)
                if got is not None:
                    return got
        return None
    try:
        return find(requests.get(url + "/server_info", timeout=30).json())
    except (requests.RequestException, ValueError):
        return None


def gpu_total_gib(timeout_s: float = 20.0) -> float | None:
    """Memory of GPU 0 in GiB from ``nvidia-smi`` (None without one)."""
    import subprocess

    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", "0"],
                           capture_output=True, text=True, timeout=timeout_s)
        return float(r.stdout.strip().splitlines()[0]) / 1024.0
    except Exception:
        return None
