"""End-to-end host-tier benchmark: concurrent long multi-turn requests at a TPOT SLO.

One GPU, three servers in turn on the same model, the same ``--mem-fraction-static`` and the same
``--max-total-tokens`` cap (a KV pool that holds only a few long contexts), the same attention backend
and page size:

  ``dense``          stock SGLang, ``--sparse off``
  ``psa_host_tier``  ``--sparse psa`` with ``host_tier_gb`` > 0 (``min_context`` low enough that decode is
                     sparse); host capacity = ``--host-ratio`` x the device KV pool, like HiCache's
  ``hicache``        ``--sparse off --enable-hierarchical-cache --hicache-ratio R`` (SGLang's own host tier)

What the host tier does today (README "Host tier"): radix nodes EVICTED from the KV pool are kept in
pinned host memory and loaded back on a prefix hit; the KV of running requests stays entirely on the
GPU (PSA decode reading only selected blocks from a GPU block cache is not implemented). So the number
of requests that can decode at once is bounded by the same device pool as dense and the expected
``concurrency_ratio_vs_dense`` is about 1; what can differ is the follow-up turns of a conversation,
which may hit the host tier instead of being recomputed (as with HiCache). This driver measures; it
assumes nothing.

Workload (identical for every server; real prose from :mod:`bench.corpus`, token-exact lengths from the
model's tokenizer): at concurrency level ``c``, ``c`` conversations run at once, closed loop, each of
``--turns`` turns. Turn 1 sends a ``--first-tokens`` document plus a question; each later turn appends the
previous reply and a ``--turn-tokens`` passage plus a question. Every reply is exactly ``--output-tokens``
tokens (``ignore_eos``), streamed through ``/v1/chat/completions``. Different levels use different
documents, so no level hits another level's cache.

Per level: output throughput (completion tokens / level wall time), TTFT and TPOT p50/p90 (TPOT of a
request = (last token time - first token time) / (tokens - 1)), turn-1 and follow-up TTFT, the fraction
of follow-up prompt tokens SGLang served from cache (``--enable-cache-report``), and the server's own
``sglang:num_running_reqs`` / ``sglang:num_queue_reqs`` gauges sampled from ``/metrics`` every
``--poll-s`` while the level runs (``--decode-log-interval`` is set equally on all servers so the gauge
is fresh), plus counter deltas (retractions, host-tier loads).

Definitions (:func:`aggregate`, unit-tested):
  * TPOT SLO = ``--slo-factor`` x dense's TPOT p50 at the smallest level (or ``--tpot-slo-ms``).
  * A level *meets the SLO* when every request succeeded, the level was not cut short by the time budget,
    and its TPOT p90 <= SLO.
  * *Sustained running requests* of a level = the median of the non-zero samples of the server's
    ``sglang:num_running_reqs`` taken while the level ran (zero samples are gaps between turns and
    prefills, not capacity); when /metrics gave no non-zero sample, the client-side count of streams
    between first and last token, time-averaged over the time at least one was open
    (``running_source`` says which).
  * *Concurrent long requests at the SLO* of a server = the largest sustained running requests over its
    levels that meet the SLO.
  * ``concurrency_ratio_vs_dense`` = psa_host_tier / dense; ``hicache_concurrency_ratio_vs_dense`` =
    hicache / dense. Null, with a ``*_reason``, when either side has no level meeting the SLO, failed to
    start, or was not run.

Outputs in ``--out``: ``host_tier_concurrency.json`` (config, per-server levels, summary) and
``host_tier_concurrency.md``; ``--merge-into PATH`` updates an existing ``host_tier.json`` (the transfer
benchmark's) with the headline keys without touching its other fields. A server that fails to start or
a level that fails is recorded with its reason; the run goes on.

``--time-budget`` (seconds, whole run) trims the sweep: each server gets an equal share of what is left;
a level is skipped when the previous level's wall time scaled by the level ratio would overrun it, and a
level past its share stops starting new turns (marked ``truncated``).

    # GPU (one H100, ~8 minutes): SmolLM2-135M, ~5.7k-token contexts, KV pool capped at 24576 tokens
    python bench/host_tier_concurrency.py --out /tmp/htc --merge-into /tmp/htc/host_tier.json
    # capacity run on a Llama-3.1-8B shape with generated weights (labelled "DUMMY weights" everywhere)
    python bench/host_tier_concurrency.py --model-shape llama8b-dummy --out /tmp/htc8b
    # CPU smoke (tests/test_host_tier_concurrency_bench.py)
    python bench/host_tier_concurrency.py --device cpu --servers dense --levels 1,2 --turns 2 \\
        --first-tokens 200 --turn-tokens 40 --output-tokens 6 --out /tmp/htc_cpu
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import requests  # noqa: E402

from bench.server import Server, ServerError, ServerSpec  # noqa: E402
from bench.conc_stats import BASELINE, HEADLINE, aggregate, summarize_level  # noqa: E402
from bench.conc_report import fmt, merge_into, write_outputs  # noqa: E402
from bench.load_client import iter_sse  # noqa: E402
from bench.prom_metrics import COUNTERS, MetricsSampler, scrape_metrics  # noqa: E402

DEFAULT_MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"
SERVER_NAMES = ("dense", "psa_host_tier", "hicache", "loopserve_host_tier")
DEFAULT_SERVERS = SERVER_NAMES[:3]  # loopserve_host_tier on request (--servers): a working-set measurement


def log(msg: str) -> None:
    """Progress line with a wall-clock stamp (flushed: the GPU script tees it)."""
    print(f"{time.strftime('%H:%M:%S')} [htc] {msg}", flush=True)


# ----------------------------------------------------------------------------------------------- config


@dataclass(frozen=True)
class BenchConfig:
    """Everything that defines one run (recorded verbatim in the JSON)."""

    model: str = str(DEFAULT_MODEL)
    model_label: str = "SmolLM2-135M-Instruct (real weights)"
    load_format: str | None = None          # "dummy" for generated weights
    device: str = "cuda"
    port: int = 32110
    python: str = sys.executable
    servers: tuple[str, ...] = DEFAULT_SERVERS
    levels: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    turns: int = 3
    first_tokens: int = 5000
    turn_tokens: int = 300
    output_tokens: int = 64
    mem_fraction_static: float = 0.3
    max_total_tokens: int = 24576           # a KV pool of ~4 long contexts (5.7k tokens each)
    page_size: int = 16
    attention_backend: str | None = "flashinfer"
    host_ratio: float = 2.0                 # host capacity / device pool, for HiCache and the host tier
    gpu_cache_mb: int = 64
    psa_min_context: int = 1024
    slo_factor: float = 1.5
    tpot_slo_ms: float | None = None
    time_budget_s: float = 420.0
    request_timeout_s: float = 120.0
    server_timeout_s: float = 300.0
    poll_s: float = 0.25
    decode_log_interval: int = 5
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = 32
    extra_server_args: tuple[str, ...] = ()
    seed: int = 0

    def __post_init__(self):
        bad = [s for s in self.servers if s not in SERVER_NAMES]
        if bad or not self.servers:
            raise ValueError(f"servers must be a non-empty subset of {SERVER_NAMES}, got {self.servers}")
        if not self.levels or any(c < 1 for c in self.levels) or list(self.levels) != sorted(set(self.levels)):
            raise ValueError(f"levels must be increasing positive integers, got {self.levels}")
        for name in ("turns", "first_tokens", "output_tokens", "max_total_tokens", "page_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.output_tokens < 2:
            raise ValueError("output_tokens must be >= 2 (TPOT needs two tokens)")
        if not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        if self.host_ratio <= 0 or self.slo_factor <= 0:
            raise ValueError("host_ratio and slo_factor must be > 0")
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device must be 'cuda' or 'cpu', got {self.device}")

    @property
    def context_tokens(self) -> int:
        """Approximate prompt length of the last turn (template tokens not counted)."""
        return self.first_tokens + (self.turns - 1) * (self.turn_tokens + self.output_tokens)


def kv_bytes_per_token(model_dir: str, dtype_bytes: int = 2) -> int:
    """K and V bytes of one token over all layers, from the model's ``config.json``."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", heads) * head_dim * 2 * dtype_bytes


def host_tier_gb(cfg: BenchConfig) -> float:
    """The psa host tier's pinned GiB: ``host_ratio`` x the device KV pool (HiCache's sizing rule)."""
    return round(cfg.host_ratio * cfg.max_total_tokens * kv_bytes_per_token(cfg.model) / 2**30, 3)


def server_spec(cfg: BenchConfig, name: str) -> ServerSpec:
    """The launch spec of one variant; everything but the variant's own flags is shared."""
    common = ["--enable-metrics", "--enable-cache-report", "--decode-log-interval", str(cfg.decode_log_interval),
              "--max-total-tokens", str(cfg.max_total_tokens)]
    if cfg.device == "cuda":
        common += ["--mem-fraction-static", str(cfg.mem_fraction_static), "--page-size", str(cfg.page_size)]
        if cfg.attention_backend:
            common += ["--attention-backend", cfg.attention_backend]
        if cfg.disable_cuda_graph:
            common += ["--disable-cuda-graph"]
        elif cfg.cuda_graph_max_bs:
            common += ["--cuda-graph-max-bs", str(cfg.cuda_graph_max_bs)]
    if cfg.load_format:
        common += ["--load-format", cfg.load_format]
    common += list(cfg.extra_server_args)
    mode, sparse_cfg, own = "off", None, []
    if name == "psa_host_tier":
        block = {"block_size": cfg.page_size} if cfg.device == "cuda" else {}
        mode = "psa"
        sparse_cfg = json.dumps({"min_context": cfg.psa_min_context, "host_tier_gb": host_tier_gb(cfg),
                                 "gpu_cache_mb": cfg.gpu_cache_mb, **block})
    elif name == "loopserve_host_tier":  # LoopServe's defaults (LoopServeConfig) above psa's min_context
        mode = "loopserve"
        sparse_cfg = json.dumps({"min_context": cfg.psa_min_context, "host_tier_gb": host_tier_gb(cfg),
                                 "gpu_cache_mb": cfg.gpu_cache_mb})
    elif name == "hicache":
        own = ["--enable-hierarchical-cache", "--hicache-ratio", str(cfg.host_ratio)]
    return ServerSpec(python=cfg.python, model=cfg.model, device=cfg.device, port=cfg.port, mode=mode,
                      sparse_config=sparse_cfg, extra_args=common + own)


# --------------------------------------------------------------------------------------------- workload


class TextMaker:
    """Token-exact prose snippets from :mod:`bench.corpus` (deterministic per seed)."""

    def __init__(self, model_dir: str):
        from transformers import AutoTokenizer

        from bench import corpus

        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.paragraphs = corpus.paragraphs()

    def text(self, n_tokens: int, seed: str) -> str:
        import random

        rng = random.Random(seed)
        ids: list[int] = []
        while len(ids) < n_tokens:
            ids += self.tok.encode(rng.choice(self.paragraphs) + "\n\n", add_special_tokens=False)
        return self.tok.decode(ids[:n_tokens])


@dataclass(frozen=True)
class Turn:
    """One user turn of a conversation."""

    user: str


def make_conversations(cfg: BenchConfig, level: int, maker: TextMaker) -> list[list[Turn]]:
    """``level`` conversations of ``cfg.turns`` user turns; documents depend on (seed, level, index)."""
    convs = []
    for i in range(level):
        tag = f"{cfg.seed}|{level}|{i}"
        turns = [Turn(f"Read this document.\n\n{maker.text(cfg.first_tokens, tag + '|doc')}\n\n"
                      f"Question 1: what is the document about?")]
        for t in range(1, cfg.turns):
            turns.append(Turn(f"More text.\n\n{maker.text(cfg.turn_tokens, f'{tag}|{t}')}\n\n"
                              f"Question {t + 1}: how does this relate to the document?"))
        convs.append(turns)
    return convs


def stream_chat(url: str, messages: list[dict], max_tokens: int, timeout_s: float) -> dict:
    """One streamed greedy chat completion of exactly ``max_tokens`` tokens; timings in monotonic seconds."""
    body = {"model": "default", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.monotonic()
    first = None
    parts: list[str] = []
    usage = None
    try:
        with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=(10, timeout_s)) as r:
            if r.status_code != 200:
                return {"ok": False, "t_start": t0, "error": f"HTTP {r.status_code}: {r.text[:300]}"}
            for data in iter_sse(r):
                obj = json.loads(data)
                if obj.get("usage"):
                    usage = obj["usage"]
                for ch in obj.get("choices") or []:
                    piece = (ch.get("delta") or {}).get("content")
                    if piece:
                        if first is None:
                            first = time.monotonic()
                        parts.append(piece)
    except (requests.RequestException, ValueError) as e:
        return {"ok": False, "t_start": t0, "error": f"{type(e).__name__}: {e}"}
    t1 = time.monotonic()
    if usage is None or first is None:
        return {"ok": False, "t_start": t0, "error": f"stream ended without {'usage' if usage is None else 'tokens'}"}
    n = int(usage.get("completion_tokens") or 0)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return {"ok": True, "t_start": t0, "t_first": first, "t_end": t1, "completion_tokens": n,
            "prompt_tokens": int(usage.get("prompt_tokens") or 0), "cached_tokens": cached,
            "ttft_s": first - t0, "tpot_s": (t1 - first) / (n - 1) if n > 1 else None, "text": "".join(parts)}


def run_conversation(url: str, turns: list[Turn], cfg: BenchConfig, deadline: float) -> list[dict]:
    """Closed loop over the turns; stops starting turns after ``deadline`` (monotonic)."""
    messages: list[dict] = []
    out = []
    for k, turn in enumerate(turns):
        if time.monotonic() > deadline:
            out.append({"ok": False, "turn": k, "skipped": True, "error": "time budget: turn not started"})
            break
        messages.append({"role": "user", "content": turn.user})
        r = stream_chat(url, messages, cfg.output_tokens, cfg.request_timeout_s)
        r["turn"] = k
        out.append(r)
        if not r["ok"]:
            break
        messages.append({"role": "assistant", "content": r.pop("text")})
    for r in out:
        r.pop("text", None)
    return out


# ------------------------------------------------------------------------------------------- driver


def run_level(url: str, cfg: BenchConfig, level: int, maker: TextMaker, deadline: float) -> dict:
    """Run ``level`` conversations at once against one server; returns :func:`summarize_level`'s dict."""
    convs = make_conversations(cfg, level, maker)
    counters0 = scrape_metrics(url, COUNTERS)
    ws0 = server_working_set(url)
    t0 = time.monotonic()
    with MetricsSampler(url, cfg.poll_s) as sampler, ThreadPoolExecutor(max_workers=level) as pool:
        futs = [pool.submit(run_conversation, url, c, cfg, deadline) for c in convs]
        results = [r for f in futs for r in f.result()]
    t1 = time.monotonic()
    counters1 = scrape_metrics(url, COUNTERS)
    truncated = any(r.get("skipped") for r in results)
    results = [r for r in results if not r.get("skipped")]
    rec = summarize_level(level, results, sampler.samples, t0, t1, counters0, counters1, truncated)
    ws1 = server_working_set(url)
    rec["working_set"] = ws1
    rec["working_set_fraction_mean"] = level_fraction_mean(ws0, ws1)
    return rec


def level_fraction_mean(ws0: dict | None, ws1: dict | None) -> float | None:
    """Mean measured working-set fraction of the admission decisions between two ``server_working_set``
    snapshots (the level's own decisions); None when none of them used a measured working set."""
    if not ws0 or not ws1 or "working_set_fraction_sum" not in ws1:
        return None
    n = ws1.get("measured_decisions", 0) - ws0.get("measured_decisions", 0)
    return (ws1["working_set_fraction_sum"] - ws0.get("working_set_fraction_sum", 0.0)) / n if n > 0 else None


def server_working_set(url: str) -> dict | None:
    """The working-set admission's statistics (``/server_info`` -> ``internal_states[0].sparse.working_set``;
    incl. ``working_set_fraction``, running requests' working sets / their context units at the last
    decision); None where the server has none (dense, HiCache) or is unreachable."""
    try:
        info = requests.get(url + "/server_info", timeout=10).json()
    except (requests.RequestException, ValueError):
        return None
    states = info.get("internal_states") or [{}]
    ws = ((states[0] or {}).get("sparse") or {}).get("working_set")
    return ws if isinstance(ws, dict) else None


def run_server(cfg: BenchConfig, name: str, out: Path, maker: TextMaker, share_s: float,
               levels: tuple[int, ...]) -> dict:
    """Start one variant, sweep its levels within ``share_s`` seconds, stop it by its process group."""
    rec: dict = {"levels": [], "error": None, "skipped_levels": [], "startup_s": None}
    spec = server_spec(cfg, name)
    rec["argv"] = spec.argv()
    t_start = time.monotonic()
    end = t_start + share_s
    server = Server(spec, out / f"server_{name}.log", timeout_s=min(cfg.server_timeout_s, share_s), log=log)
    _CURRENT.append(server)
    try:
        try:
            server.start()
        except (ServerError, OSError) as e:
            rec["error"] = f"server failed to start: {e}"
            log(f"{name}: {rec['error'].splitlines()[0]}")
            return rec
        if not server.pid:
            raise ServerError(f"{name}: launched server has no pid; cannot stop it by process group")
        rec["startup_s"] = server.startup_s
        prev: tuple[int, float] | None = None
        for i, level in enumerate(levels):
            now = time.monotonic()
            predicted = prev[1] * level / prev[0] if prev else 0.0
            if now + predicted > end:
                rec["skipped_levels"] = list(levels[i:])
                log(f"{name}: time budget -> skip levels {rec['skipped_levels']} "
                    f"(next predicted {predicted:.0f}s, {end - now:.0f}s left)")
                break
            log(f"{name}: level {level} ({level} conversations x {cfg.turns} turns) ...")
            try:
                r = run_level(server.url, cfg, level, maker, deadline=end)
            except Exception as e:  # a level never kills the run: recorded, next server goes on
                rec["error"] = f"level {level}: {type(e).__name__}: {e}"
                log(f"{name}: {rec['error']}\n{traceback.format_exc()}")
                break
            rec["levels"].append(r)
            prev = (level, r["wall_s"])
            log(f"{name}: level {level}: {r['ok']}/{r['requests']} ok, {r['output_tok_s']:.1f} out tok/s, "
                f"TPOT p50/p90 {fmt(r['tpot_ms_p50'])}/{fmt(r['tpot_ms_p90'])} ms, TTFT p50 {fmt(r['ttft_ms_p50'])} ms, "
                f"running {fmt(r['sustained_running'])} (max {fmt(r['server_running_max'])}), "
                f"queue max {fmt(r['server_queue_max'])}, follow-up cached {fmt(r['followup_cached_fraction'], 2)}, "
                f"{r['wall_s']:.1f}s{' TRUNCATED' if r['truncated'] else ''}")
            if r["failed"]:
                log(f"{name}: level {level} errors: {r['errors']}")
            if r["truncated"]:
                rec["skipped_levels"] = list(levels[i + 1:])
                break
        return rec
    finally:
        server.stop()  # by its process group (bench.server); a no-op if it never started
        _CURRENT.remove(server)


_CURRENT: list[Server] = []  # the server being benchmarked, for the SIGTERM handler


def _on_sigterm(signum, frame):
    """``timeout`` sends SIGTERM: stop the running server by its process group first, then unwind."""
    for srv in list(_CURRENT):
        srv.stop()
    raise KeyboardInterrupt


def device_name(device: str) -> str:
    if device != "cuda":
        return "cpu"
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cuda (not available here)"
    except Exception as e:  # noqa: BLE001 - report, do not fail
        return f"cuda (unknown: {e})"


def run(cfg: BenchConfig, out: Path, merge_path: Path | None = None, command: str = "") -> dict:
    """The whole benchmark: every server in turn, the aggregation, the outputs. Returns the JSON doc."""
    t_run = time.monotonic()
    meta = {"command": command, "device": device_name(cfg.device), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    out.mkdir(parents=True, exist_ok=True)
    log(f"model {cfg.model_label}; servers {list(cfg.servers)}; levels {list(cfg.levels)}; "
        f"budget {cfg.time_budget_s:.0f}s; out {out}")
    maker = TextMaker(cfg.model)
    # the headline comparison first: baseline, then psa_host_tier, then hicache (trimmed first if short)
    order = [n for n in (BASELINE, HEADLINE, "hicache", "loopserve_host_tier") if n in cfg.servers]
    servers: dict[str, dict] = {}
    for i, name in enumerate(order):
        left = cfg.time_budget_s - (time.monotonic() - t_run)
        share = left / (len(order) - i)
        if share < 10:
            servers[name] = {"levels": [], "error": f"not run: time budget exhausted ({left:.0f}s left)",
                             "skipped_levels": list(cfg.levels), "startup_s": None}
            log(f"{name}: {servers[name]['error']}")
            continue
        log(f"== {name}: {share:.0f}s share")
        try:
            servers[name] = run_server(cfg, name, out, maker, share, cfg.levels)
        except KeyboardInterrupt:
            servers[name] = {"levels": [], "error": "interrupted (SIGINT/SIGTERM); later servers not run",
                             "skipped_levels": list(cfg.levels), "startup_s": None}
            log(f"{name}: interrupted; writing what was measured")
            break
        summary = aggregate(servers, cfg.slo_factor, cfg.tpot_slo_ms)
        write_outputs(out, cfg, servers, summary, dict(meta, wall_s=time.monotonic() - t_run), host_tier_gb(cfg))
    summary = aggregate(servers, cfg.slo_factor, cfg.tpot_slo_ms)
    meta["wall_s"] = time.monotonic() - t_run
    doc = write_outputs(out, cfg, servers, summary, meta, host_tier_gb(cfg))
    if merge_path is not None:
        merge_into(merge_path, summary, cfg, meta)
        log(f"merged headline keys into {merge_path}")
    log(f"concurrency_ratio_vs_dense = {summary['concurrency_ratio_vs_dense']}"
        + (f" ({summary['concurrency_ratio_vs_dense_reason']})" if summary["concurrency_ratio_vs_dense_reason"] else "")
        + f"; hicache/dense = {summary['hicache_concurrency_ratio_vs_dense']}; wall {meta['wall_s']:.0f}s; "
          f"report {out / 'host_tier_concurrency.md'}")
    return doc


def parse_args(argv=None) -> tuple[BenchConfig, Path, Path | None]:
    d = BenchConfig()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="report folder")
    p.add_argument("--merge-into", default=None, help="host_tier.json to update with the headline keys")
    p.add_argument("--model", default=None, help=f"model folder (default {DEFAULT_MODEL})")
    p.add_argument("--model-shape", choices=["real", "llama8b-dummy"], default="real",
                   help="llama8b-dummy: Llama-3.1-8B shape with generated weights (bench/dummy_model.py)")
    p.add_argument("--device", default=d.device, choices=["cuda", "cpu"])
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--servers", default=",".join(d.servers), help=f"subset of {','.join(SERVER_NAMES)}")
    p.add_argument("--levels", default=",".join(map(str, d.levels)), help="concurrency levels (conversations)")
    p.add_argument("--turns", type=int, default=d.turns)
    p.add_argument("--first-tokens", type=int, default=d.first_tokens)
    p.add_argument("--turn-tokens", type=int, default=d.turn_tokens)
    p.add_argument("--output-tokens", type=int, default=d.output_tokens)
    p.add_argument("--mem-fraction-static", type=float, default=d.mem_fraction_static)
    p.add_argument("--max-total-tokens", type=int, default=d.max_total_tokens)
    p.add_argument("--page-size", type=int, default=d.page_size)
    p.add_argument("--attention-backend", default=d.attention_backend, help="'' = SGLang's default")
    p.add_argument("--host-ratio", type=float, default=d.host_ratio)
    p.add_argument("--gpu-cache-mb", type=int, default=d.gpu_cache_mb)
    p.add_argument("--psa-min-context", type=int, default=d.psa_min_context)
    p.add_argument("--slo-factor", type=float, default=d.slo_factor)
    p.add_argument("--tpot-slo-ms", type=float, default=None)
    p.add_argument("--time-budget", type=float, default=d.time_budget_s, help="seconds for the whole run")
    p.add_argument("--request-timeout", type=float, default=d.request_timeout_s)
    p.add_argument("--server-timeout", type=float, default=d.server_timeout_s)
    p.add_argument("--poll-s", type=float, default=d.poll_s)
    p.add_argument("--decode-log-interval", type=int, default=d.decode_log_interval)
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--cuda-graph-max-bs", type=int, default=d.cuda_graph_max_bs)
    p.add_argument("--server-args", default="", help="extra args for every server (shlex-split)")
    p.add_argument("--seed", type=int, default=d.seed)
    a = p.parse_args(argv)
    import shlex

    model, label, load_format = a.model or str(DEFAULT_MODEL), d.model_label, None
    if a.model_shape == "llama8b-dummy":
        from bench.dummy_model import LABEL, make_dummy_llama8b

        model = str(make_dummy_llama8b(a.model or DEFAULT_MODEL, Path(a.out) / "llama8b_dummy_model"))
        label, load_format = LABEL, "dummy"
    elif a.model:
        label = Path(a.model).name
    cfg = BenchConfig(
        model=model, model_label=label, load_format=load_format, device=a.device, port=a.port,
        servers=tuple(s.strip() for s in a.servers.split(",") if s.strip()),
        levels=tuple(int(x) for x in a.levels.split(",") if x.strip()), turns=a.turns,
        first_tokens=a.first_tokens, turn_tokens=a.turn_tokens, output_tokens=a.output_tokens,
        mem_fraction_static=a.mem_fraction_static, max_total_tokens=a.max_total_tokens, page_size=a.page_size,
        attention_backend=a.attention_backend or None, host_ratio=a.host_ratio, gpu_cache_mb=a.gpu_cache_mb,
        psa_min_context=a.psa_min_context, slo_factor=a.slo_factor, tpot_slo_ms=a.tpot_slo_ms,
        time_budget_s=a.time_budget, request_timeout_s=a.request_timeout, server_timeout_s=a.server_timeout,
        poll_s=a.poll_s, decode_log_interval=a.decode_log_interval, disable_cuda_graph=a.disable_cuda_graph,
        cuda_graph_max_bs=a.cuda_graph_max_bs or None, extra_server_args=tuple(shlex.split(a.server_args)),
        seed=a.seed)
    return cfg, Path(a.out), Path(a.merge_into) if a.merge_into else None


def main(argv=None) -> int:
    """CLI entry; exit 0 when every requested server ran at least one level, else 1 (outputs written)."""
    try:
        cfg, out, merge = parse_args(argv)
    except ValueError as e:
        print(f"host_tier_concurrency: bad arguments: {e}", file=sys.stderr)
        return 2
    cmd = " ".join([sys.executable, "bench/host_tier_concurrency.py", *(argv if argv is not None else sys.argv[1:])])
    signal.signal(signal.SIGTERM, _on_sigterm)
    doc = run(cfg, out, merge, cmd)
    bad = [n for n, s in doc["servers"].items() if s.get("error") or not s["levels"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
