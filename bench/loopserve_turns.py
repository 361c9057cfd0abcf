"""Multi-turn line reuse: TTFT of each turn of long conversations and the share of lines reused from earlier turns.

    python -m bench.loopserve_turns --launch --model /tmp/models/SmolLM2-135M-Instruct-32k --device cuda \\
        --configs 'off,loopserve,loopserve_engaged=loopserve:{"min_context": 4096}' \\
        --turns 3 --turn-tokens 8192 --conversations 6 --server-args '--attention-backend flashinfer' --out DIR

Each conversation is ``--turns`` turns of ``--turn-tokens`` tokens of real prose (token-exact, :mod:`bench.corpus`).
Turn ``k``'s prompt is turn ``k-1``'s prompt + its ``--max-new-tokens`` greedy output ids + ``--turn-tokens`` new
tokens, so SGLang's radix cache holds every earlier turn and only the new turn is prefilled. Every request is a
streamed native ``/generate`` (``ignore_eos``): TTFT is the time to the first streamed chunk; the last chunk gives
the output ids, ``cached_tokens`` and LoopServe's step rows (:func:`sglang_sparse.loopserve.stats.summarize_steps`).

Per config and turn the report gives the mean and median TTFT, TTFT against turn 1 of the same config, TTFT
against the baseline config (``off`` when present) at the same turn, the mean cached prefix, and for LoopServe:

* ``reused_lines``: lines of earlier turns found on the radix path (summed over layers x KV heads);
* ``reused_fraction``: reused / (reused + this turn's selected vertical and slash lines);
* ``line_fraction``: this turn's selected lines / candidate lines; ``sparse_prefill_share``: requests whose
  prefill ran sparsely.

Conversations run one at a time (concurrency 1), after one warm-up conversation per server that is not counted
(kernel compilation, allocator growth); the radix cache is flushed after the warm-up. Servers are started one at a
time (``--launch``) or given as ``--url LABEL=URL``. Outputs in ``--out``: ``loopserve_turns.json`` and
``loopserve_turns.md``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import requests

from bench import envinfo
from bench import load_client as lc
from bench.server import Server, ServerError, ServerSpec

BASELINE = "off"


def parse_configs(text: str) -> list[tuple[str, str, str | None]]:
    """``LABEL=MODE[:JSON]`` or ``MODE`` items, comma-separated at the top level -> ``[(label, mode, json)]``."""
    items, depth, cur = [], 0, ""
    for ch in text:
        depth += ch in "{[" and 1 or (-1 if ch in "}]" else 0)
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    items.append(cur)
    out = []
    for item in (i.strip() for i in items):
        if not item:
            continue
        head = item.split(":", 1)[0]
        label, spec = item.split("=", 1) if "=" in head else (head, item)
        mode, _, cfg = spec.partition(":")
        if cfg:
            try:
                json.loads(cfg)
            except ValueError as e:
                raise ValueError(f"--configs: the sparse config of '{label}' is not JSON: {e}") from None
        if not mode.strip():
            raise ValueError(f"--configs: item '{item}' names no mode")
        out.append((label.strip(), mode.strip(), cfg or None))
    labels = [c[0] for c in out]
    if len(set(labels)) != len(labels):
        raise ValueError(f"--configs: duplicate labels in {labels}")
    return out


def stream_generate(url: str, ids: list[int], max_new: int, timeout_s: float) -> dict:
    """One streamed greedy ``/generate`` of exactly ``max_new`` tokens: TTFT, output ids and the last meta_info."""
    from sglang_sparse.loopserve.stats import STEP_KEY, summarize_steps

    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new, "ignore_eos": True}}
    t0 = time.monotonic()
    first, last = None, None
    try:
        with requests.post(url + "/generate", json=body, stream=True, timeout=(10, timeout_s)) as r:
            if r.status_code != 200:
                return {"ok": False, "error": f"HTTP {r.status_code}: {r.text[:300]}"}
            for data in lc.iter_sse(r):
                if first is None:
                    first = time.monotonic()
                last = data
    except requests.RequestException as e:
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    if last is None:
        return {"ok": False, "error": "stream ended without a chunk"}
    obj = json.loads(last)
    if obj.get("error"):
        return {"ok": False, "error": str(obj["error"])[:300]}
    meta = obj.get("meta_info") or {}
    out_ids = list(obj.get("output_ids") or [])
    if len(out_ids) != max_new:
        return {"ok": False, "error": f"{len(out_ids)} output ids, {max_new} asked"}
    return {"ok": True, "ttft_s": first - t0, "e2e_s": time.monotonic() - t0, "output_ids": out_ids,
            "prompt_tokens": int(meta.get("prompt_tokens") or len(ids)),
            "cached_tokens": int(meta.get("cached_tokens") or 0), "sparse": summarize_steps(meta.get(STEP_KEY))}


def run_conversation(url: str, maker, seed: int, turns: int, turn_tokens: int, max_new: int,
                     timeout_s: float) -> list[dict]:
    """One conversation; a failed turn ends it (later turns would miss their prefix)."""
    rng = random.Random(f"turns|{seed}")
    ids: list[int] = []
    out = []
    for k in range(turns):
        ids = ids + maker.prompt(turn_tokens, rng, rng.randrange(len(maker.paras)))
        r = stream_generate(url, ids, max_new, timeout_s)
        r["turn"] = k + 1
        r["input_tokens"] = len(ids)
        out.append(r)
        if not r["ok"]:
            break
        ids = ids + r.pop("output_ids")
    return out


def summarize_turns(convs: list[list[dict]], turns: int) -> list[dict]:
    """Per turn: TTFT (mean, median, ms), cached prefix, LoopServe's line counts over the conversations' turn k."""
    rows = []
    for k in range(1, turns + 1):
        rs = [c[k - 1] for c in convs if len(c) >= k]
        ok = [r for r in rs if r["ok"]]
        ttft = [1e3 * r["ttft_s"] for r in ok]
        sp = [r["sparse"] for r in ok if r.get("sparse")]
        reused = sum(int(s["reused_lines"]) for s in sp)
        sel = sum(int(s["vertical_lines"]) + int(s["slash_lines"]) for s in sp)
        cand = sum(int(s["lines_total"]) for s in sp)
        rows.append({
            "turn": k, "requests": len(rs), "failed": len(rs) - len(ok),
            "errors": sorted({r["error"] for r in rs if not r["ok"]})[:3],
            "input_tokens_mean": statistics.fmean([r["input_tokens"] for r in ok]) if ok else None,
            "cached_tokens_mean": statistics.fmean([r["cached_tokens"] for r in ok]) if ok else None,
            "ttft_ms_mean": statistics.fmean(ttft) if ttft else None,
            "ttft_ms_median": statistics.median(ttft) if ttft else None,
            "sparse_prefill_share": (sum(1 for s in sp if s["sparse_prefill"]) / len(ok)) if ok else None,
            "reused_lines": reused, "selected_lines": sel,
            "reused_fraction": reused / (reused + sel) if reused + sel else None,
            "line_fraction": sel / cand if cand else None,
        })
    return rows


def add_ratios(report: dict) -> None:
    """``ttft_vs_turn1`` within a config and ``ttft_vs_<baseline>`` at the same turn (mean TTFT)."""
    base = report["configs"].get(BASELINE)
    for label, cfg in report["configs"].items():
        turns = cfg.get("turns") or []
        t1 = turns[0]["ttft_ms_mean"] if turns else None
        for row in turns:
            m = row["ttft_ms_mean"]
            row["ttft_vs_turn1"] = m / t1 if m and t1 else None
            b = (base or {}).get("turns") or []
            bm = b[row["turn"] - 1]["ttft_ms_mean"] if len(b) >= row["turn"] else None
            row[f"ttft_vs_{BASELINE}"] = m / bm if m and bm and label != BASELINE else None


def render_md(report: dict) -> str:
    f = lambda x, p=3: "-" if x is None else (f"{x:.{p}g}" if isinstance(x, float) else str(x))  # noqa: E731
    m = report["meta"]
    lines = ["# LoopServe line reuse across turns (bench.loopserve_turns)", "",
             f"- command: {m['command']}", f"- gpu: {m.get('gpu')}", f"- model: {m['model']}",
             f"- versions: {m.get('versions')}",
             f"- conversations: {m['conversations']} x {m['turns']} turns of {m['turn_tokens']} tokens, "
             f"{m['max_new_tokens']} output tokens per turn (ignore_eos), concurrency 1, one warm-up conversation "
             "per server not counted", ""]
    lines += ["| config | turn | input tokens | cached | TTFT mean ms | median ms | vs turn 1 | vs off | "
              "sparse prefill | reused lines | reused fraction | line fraction | failed |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, cfg in report["configs"].items():
        if cfg.get("error"):
            lines.append(f"| {label} | - | error: {cfg['error'][:200]} |")
            continue
        for r in cfg["turns"]:
            lines.append(f"| {label} | {r['turn']} | {f(r['input_tokens_mean'], 5)} | {f(r['cached_tokens_mean'], 5)} | "
                         f"{f(r['ttft_ms_mean'])} | {f(r['ttft_ms_median'])} | {f(r['ttft_vs_turn1'])} | "
                         f"{f(r.get('ttft_vs_' + BASELINE))} | {f(r['sparse_prefill_share'])} | {r['reused_lines']} | "
                         f"{f(r['reused_fraction'])} | {f(r['line_fraction'])} | {r['failed']} |")
    lines += ["", "Configs: " + "; ".join(f"`{lab}`: --sparse {c['mode']}"
                                          + (f" --sparse-config '{c['sparse_config']}'" if c.get("sparse_config") else "")
                                          for lab, c in report["configs"].items()), ""]
    return "\n".join(lines)


def run_config(url: str, maker, a, log) -> dict:
    """Warm-up conversation, cache flush, then ``a.conversations`` conversations one at a time."""
    run_conversation(url, maker, -1, a.turns, a.turn_tokens, a.max_new_tokens, a.timeout)
    if not lc.flush_cache(url):
        log("[turns] /flush_cache refused: turn 1 may hit the warm-up's prefix")
    convs = []
    for c in range(a.conversations):
        conv = run_conversation(url, maker, c, a.turns, a.turn_tokens, a.max_new_tokens, a.timeout)
        convs.append(conv)
        log(f"[turns] conversation {c + 1}/{a.conversations}: TTFT ms "
            + ", ".join("-" if not r["ok"] else f"{1e3 * r['ttft_s']:.1f}" for r in conv))
    return {"turns": summarize_turns(convs, a.turns)}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m bench.loopserve_turns", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="off,loopserve",
                    help="comma-separated LABEL=MODE[:JSON] or MODE items (default: off,loopserve)")
    ap.add_argument("--url", action="append", default=[], metavar="LABEL=URL",
                    help="use a running server for a config label instead of launching one (repeat)")
    ap.add_argument("--launch", action="store_true", help="start each config's server, one at a time (needs --model)")
    ap.add_argument("--model", required=True, help="model folder (its tokenizer builds the prompts)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--port", type=int, default=30040)
    ap.add_argument("--server-args", default="", help="extra arguments of every launched server")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--turn-tokens", type=int, default=8192)
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    ap.add_argument("--server-timeout", type=float, default=900.0, help="seconds for a server to become ready")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    for name in ("turns", "turn_tokens", "conversations", "max_new_tokens"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    try:
        configs = parse_configs(a.configs)
    except ValueError as e:
        ap.error(str(e))
    urls = dict(u.split("=", 1) for u in a.url if "=" in u)
    if len(urls) != len(a.url):
        ap.error("--url takes LABEL=URL")
    missing = [lab for lab, _, _ in configs if lab not in urls]
    if missing and not a.launch:
        ap.error(f"no --url for {missing}: give one per config or --launch")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    def log(msg):
        print(msg, flush=True)

    maker = lc.PromptMaker(a.model)
    env = envinfo.collect(a.python, [sys.executable, "-m", "bench.loopserve_turns"] + argv)
    report = {"meta": {"command": " ".join(["python -m bench.loopserve_turns"] + argv), "model": a.model,
                       "gpu": env.get("gpu"), "versions": env.get("versions"), "date_utc": env.get("date_utc"),
                       "turns": a.turns,
                       "turn_tokens": a.turn_tokens, "conversations": a.conversations,
                       "max_new_tokens": a.max_new_tokens}, "configs": {}}
    extra = a.server_args.split()
    for i, (label, mode, cfg) in enumerate(configs):
        entry = {"mode": mode, "sparse_config": cfg}
        log(f"[turns] config {label}: --sparse {mode} {cfg or ''}")
        try:
            if label in urls:
                entry.update(run_config(urls[label].rstrip("/"), maker, a, log))
            else:
                spec = ServerSpec(python=a.python, model=a.model, device=a.device, port=a.port + i, mode=mode,
                                  sparse_config=cfg, extra_args=extra)
                with Server(spec, out / f"server_{label}.log", timeout_s=a.server_timeout, log=log) as server:
                    entry.update(run_config(server.url, maker, a, log))
        except (ServerError, requests.RequestException) as e:
            entry["error"] = f"{type(e).__name__}: {e}"[:2000]
            log(f"[turns] config {label} failed: {entry['error'][:300]}")
        report["configs"][label] = entry
        add_ratios(report)
        (out / "loopserve_turns.json").write_text(json.dumps(report, indent=1))
        (out / "loopserve_turns.md").write_text(render_md(report))
    log(render_md(report))
    failed = any(c.get("error") or any(r["failed"] for r in c.get("turns", [])) for c in report["configs"].values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
