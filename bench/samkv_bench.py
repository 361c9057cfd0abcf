"""SamKV end-to-end benchmark (issue 7) against a ``--sparse samkv`` server: TTFT, KV kept, accuracy.

Tasks (:func:`make_task`): ``docs`` documents of real text (bench.corpus) each carrying one planted fact;
one document holds the asked person's secret number, the others a distractor fact about other people.
The question goes in the chat message; the documents in ``extra_body.documents``.

Per task, on one server (variants chosen per request with ``samkv.variant``):
  1. warm-up: the documents with another question (``max_tokens`` 1): every document gets prefilled and
     cached alone; the composite of that other question is not reused by step 2 (its namespace hashes
     the question).
  2. TTFT of ``samkv`` (documents cached) and of ``recompute`` (dense prefill of the whole concatenation,
     a fresh namespace every time): latency of a non-streaming request with ``max_tokens`` 1 (the
     documents API refuses streaming), median over ``--repeats`` fresh questions per task (each repeat
     asks the same fact with different wording, so no composite is reused).
  3. accuracy: greedy answers (``--max-tokens``) of ``recompute``, ``samkv`` and ``reuse``; exact match of
     the planted number.

Writes ``samkv.md`` and ``samkv.json`` into ``--out``; the JSON's headline keys are computed from the
runs: ``ttft_ratio_vs_recompute`` = median samkv TTFT / median recompute TTFT, ``kv_kept_ratio`` = mean
of the server-reported kept ratio of the samkv requests, ``accuracy_delta_vs_recompute`` = (samkv
accuracy - recompute accuracy) in points. ``--launch`` starts the server (bench.server) and stops it by
its process group.

    python -m bench.samkv_bench --launch --device cuda --model $KIT_MODEL --out bench/results \\
        --server-args "--attention-backend flashinfer --page-size 16"
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import requests

from bench import tasks as T

WORDINGS = ("What is {n}'s secret number?", "Which number is {n}'s secret number?",
            "Tell me the secret number of {n}.", "{n} has a secret number. What is it?")


@dataclass(frozen=True)
class SamKVTask:
    tid: str
    documents: tuple[str, ...]
    name: str
    answer: str
    needed_doc: int


def make_task(seed: int, docs: int = 8, words: int = 760) -> SamKVTask:
    """One deterministic multi-document task: ``docs`` documents of ~``words`` words, one holds the fact."""
    rng = random.Random(f"samkv|{docs}|{words}|{seed}")
    d = T._Draw(rng)
    titles = rng.sample(T.DOC_TITLES, min(docs, len(T.DOC_TITLES)))
    needed = rng.randrange(docs)
    name, number = d.name(), d.number()
    out = []
    for i in range(docs):
        fact = T._fact(name, number) if i == needed else T._distractor(d.name(), rng.choice(T.COLOURS))
        out.append(f"{titles[i % len(titles)]}\n" + " ".join(T._turn_text(words, [fact], rng)))
    return SamKVTask(f"samkv-d{docs}-w{words}-s{seed}", tuple(out), name, number, needed)


def ask(url: str, task: SamKVTask, variant: str, max_tokens: int, wording: int = 0, timeout: float = 900.0,
        salt: str | None = None) -> dict:
    """One documents request; returns ``{"latency_s", "text", "sparse"}`` (raises on HTTP errors)."""
    question = WORDINGS[wording % len(WORDINGS)].format(n=task.name) + " " + T.TRAILER
    body = {"model": "default", "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0, "documents": list(task.documents), "samkv": {"variant": variant}}
    if salt is not None:
        body["cache_salt"] = salt
    t0 = time.perf_counter()
    r = requests.post(url + "/v1/chat/completions", json=body, timeout=timeout)
    dt = time.perf_counter() - t0
    if r.status_code != 200:
        raise RuntimeError(f"{variant}: HTTP {r.status_code}: {r.text[:500]}")
    j = r.json()
    return {"latency_s": dt, "text": j["choices"][0]["message"]["content"] or "",
            "sparse": (j.get("metadata") or {}).get("sparse") or {}}


def correct(text: str, answer: str) -> bool:
    from bench.scoring import extract_numbers

    nums = extract_numbers(text)
    return bool(nums) and nums[0] == answer


def run(url: str, n_tasks: int, docs: int, words: int, repeats: int, max_tokens: int, log=print,
        ttft_only: bool = False) -> dict:
    rows = []
    for seed in range(n_tasks):
        task = make_task(seed, docs, words)
        warm = ask(url, task, "samkv", 1, wording=len(WORDINGS) - 1)
        ttft = {"samkv": [], "recompute": []}
        kept, phases = [], []
        for rep in range(repeats):
            for variant in ("recompute", "samkv"):
                r = ask(url, task, variant, 1, wording=rep)
                ttft[variant].append(r["latency_s"])
                if variant == "samkv":
                    kept.append(r["sparse"].get("kv_kept_ratio"))
                    phases.append({"front_ms": r["sparse"].get("front_ms"),
                                   "scheduler_ms": r["sparse"].get("scheduler_ms")})
        variants = () if ttft_only else ("recompute", "samkv", "reuse")
        answers = {v: ask(url, task, v, max_tokens, wording=0) for v in variants}
        row = {"task": task.tid, "answer": task.answer, "needed_doc": task.needed_doc,
               "document_tokens": warm["sparse"].get("document_tokens"),
               "warm_documents_prefilled": warm["sparse"].get("documents_prefilled"),
               "ttft_s": {v: statistics.median(x) for v, x in ttft.items()},
               "kv_kept_ratio": statistics.fmean(k for k in kept if k is not None) if any(
                   k is not None for k in kept) else None,
               "samkv_timing_ms": phases,
               "correct": {v: correct(a["text"], task.answer) for v, a in answers.items()},
               "replies": {v: a["text"] for v, a in answers.items()},
               "metadata": {v: a["sparse"] for v, a in answers.items()}}
        log(f"[samkv_bench] {task.tid}: tokens={row['document_tokens']} ttft={row['ttft_s']} "
            f"kept={row['kv_kept_ratio']} correct={row['correct']} last samkv timing={phases[-1] if phases else None}")
        rows.append(row)
    med = {v: statistics.median(r["ttft_s"][v] for r in rows) for v in ("samkv", "recompute")}
    acc = {v: (None if ttft_only else sum(r["correct"][v] for r in rows) / len(rows))
           for v in ("recompute", "samkv", "reuse")}
    kept_vals = [r["kv_kept_ratio"] for r in rows if r["kv_kept_ratio"] is not None]
    return {"rows": rows, "ttft_median_s": med, "accuracy": acc,
            "ttft_ratio_vs_recompute": med["samkv"] / med["recompute"],
            "kv_kept_ratio": statistics.fmean(kept_vals) if kept_vals else None,
            "accuracy_delta_vs_recompute": None if ttft_only else 100.0 * (acc["samkv"] - acc["recompute"])}


def _gpu_name() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:
        pass
    return "none (CPU run)"


def write_report(out: Path, res: dict, facts: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    head = {"gpu": facts["gpu"], "model": facts.get("model"), "weights": facts.get("weights", "real"),
            "ttft_ratio_vs_recompute": res["ttft_ratio_vs_recompute"], "ttft_median_s": res["ttft_median_s"],
            "kv_kept_ratio": res["kv_kept_ratio"], "accuracy_delta_vs_recompute": res["accuracy_delta_vs_recompute"]}
    (out / "samkv.json").write_text(json.dumps({**head, "details": {**facts, **res}}, indent=1))
    acc = res["accuracy"]
    fmt = lambda x: "n/a (dummy weights)" if x is None else f"{x:.3f}"  # noqa: E731
    lines = ["# SamKV: per-document KV reuse + block selection (`--sparse samkv`)", "",
             f"- model: {facts.get('model')} ({facts.get('weights', 'real')} weights)",
             f"- command: `{facts['command']}`", f"- GPU: {facts['gpu']}", f"- server: {facts.get('server', '?')}",
             f"- tasks: {len(res['rows'])} x {facts['docs']} documents of ~{facts['words']} words "
             f"(document tokens per task: {[r['document_tokens'] for r in res['rows']]})", "",
             "| figure | value |", "|---|---|",
             f"| TTFT samkv / full recompute (median, docs cached) | {res['ttft_ratio_vs_recompute']:.3f} |",
             f"| TTFT median samkv / recompute (s) | {res['ttft_median_s']['samkv']:.4f} / "
             f"{res['ttft_median_s']['recompute']:.4f} |",
             f"| KV kept ratio (samkv) | {res['kv_kept_ratio']} |",
             f"| accuracy recompute / samkv / reuse | {fmt(acc['recompute'])} / {fmt(acc['samkv'])} / "
             f"{fmt(acc['reuse'])} |",
             f"| accuracy delta samkv - recompute (points) | {fmt(res['accuracy_delta_vs_recompute'])} |", "",
             "TTFT = latency of a non-streaming request with max_tokens 1 (documents cached and known to the "
             "front door). samkv = reuse + SamKV block selection + selective recompute (server config); reuse = "
             "every block, no recompute; recompute = dense prefill of the concatenation.", "",
             "| task | answer | recompute | samkv | reuse | kept |", "|---|---|---|---|---|---|"]
    for r in res["rows"]:
        rp = r["replies"]
        lines.append(f"| {r['task']} | {r['answer']} | {rp.get('recompute')!r} | {rp.get('samkv')!r} | "
                     f"{rp.get('reuse')!r} | {r['kv_kept_ratio']} |")
    last = [t for r in res["rows"] for t in r.get("samkv_timing_ms", [])]
    if last:
        lines += ["", "Where a samkv request's time went (last timed request, ms; front door phases and the "
                  "scheduler's CUDA-synchronised assembly phases):", "", f"`{json.dumps(last[-1])}`"]
    (out / "samkv.md").write_text("\n".join(lines) + "\n")


def add_to_headline(path: Path, res: dict, facts: dict, source: Path) -> None:
    """Record this run's TTFT figures (computed above) under ``ttft_by_model[<model label>]`` of ``path``."""
    head = json.loads(path.read_text()) if path.exists() else {}
    head.setdefault("ttft_by_model", {})[facts["model"]] = {
        "weights": facts["weights"], "gpu": facts["gpu"], "ttft_ratio_vs_recompute": res["ttft_ratio_vs_recompute"],
        "ttft_median_s": res["ttft_median_s"], "kv_kept_ratio": res["kv_kept_ratio"], "tasks": len(res["rows"]),
        "source": str(source)}
    path.write_text(json.dumps(head, indent=1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running --sparse samkv server")
    ap.add_argument("--launch", action="store_true", help="start a server (needs --model)")
    ap.add_argument("--model")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--port", type=int, default=30010)
    ap.add_argument("--sparse-config", default=None)
    ap.add_argument("--server-args", default="")
    ap.add_argument("--tasks", type=int, default=6)
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--words", type=int, default=760, help="words per document (~960 tokens of this text: 8 fit the 8k context of SmolLM2)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--ttft-only", action="store_true", help="no accuracy requests (dummy-weight runs)")
    ap.add_argument("--dummy-8b", metavar="DIR", help="build a Llama-3.1-8B-shaped folder in DIR from --model's "
                    "tokenizer (bench.dummy_model), serve it with --load-format dummy; implies --ttft-only")
    ap.add_argument("--headline", metavar="JSON", help="also add this run's TTFT figures, with their model and "
                    "weights, under 'ttft_by_model' of this samkv.json (the real-model run's headline)")
    a = ap.parse_args(argv)
    weights, model_label = "real", a.model
    if a.dummy_8b:
        from bench.dummy_model import LABEL, make_dummy_llama8b

        a.model = str(make_dummy_llama8b(a.model, a.dummy_8b))
        a.server_args = (a.server_args + " --load-format dummy").strip()
        a.ttft_only, weights, model_label = True, "dummy", LABEL
    facts = {"command": " ".join(shlex.quote(x) for x in [sys.executable, "-m", "bench.samkv_bench"] + (argv or sys.argv[1:])),
             "gpu": _gpu_name() if a.device == "cuda" else "none (CPU run)", "docs": a.docs, "words": a.words,
             "model": model_label, "weights": weights}
    server = None
    url = a.url
    if a.launch:
        from bench.server import Server, ServerSpec

        spec = ServerSpec(python=a.python, model=a.model, device=a.device, port=a.port, mode="samkv",
                          sparse_config=a.sparse_config, extra_args=shlex.split(a.server_args))
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        server = Server(spec, out / "samkv_server.log", timeout_s=600).start()
        url = server.url
        facts["server"] = " ".join(spec.argv())
    if not url:
        ap.error("give --url or --launch")
    try:
        res = run(url, a.tasks, a.docs, a.words, a.repeats, a.max_tokens, ttft_only=a.ttft_only)
    finally:
        if server is not None:
            server.stop()
    write_report(Path(a.out), res, facts)
    add_to_headline(Path(a.out) / "samkv.json", res, facts, Path(a.out) / "samkv.json")
    if a.headline:
        add_to_headline(Path(a.headline), res, facts, Path(a.out) / "samkv.json")
    print(json.dumps({k: res[k] for k in ("ttft_ratio_vs_recompute", "kv_kept_ratio", "accuracy_delta_vs_recompute",
                                          "accuracy", "ttft_median_s")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
