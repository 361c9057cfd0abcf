"""SamKV end-to-end benchmark against a ``--sparse samkv`` server: TTFT, KV kept, accuracy.

Tasks (:func:`make_task`): ``docs`` documents of real text (bench.corpus) each carrying one planted fact;
one document holds the asked person's secret number, the others a distractor fact about other people.
The documents go in ``extra_body.documents``. Two task sets, one server, one report (:class:`BenchPlan`):

* **accuracy set** (``--acc-tasks`` x ``--acc-docs`` documents of ``--acc-words`` words; default 60 x 8 x
  400 words, ~550 tokens each, ~4.4k in all): short enough that SmolLM2-135M's *dense* prefill answers them
  (it fails the long set even densely), long enough that the 0.2 KV cap leaves room to select blocks (at
  120 words the initial + local blocks take all but 0-7 blocks of 16 tokens).
  Asked through ``/v1/completions`` with the raw prompt
  ``Question: What is <name>'s secret number?\nAnswer: The answer is`` after the documents (no chat
  template: measured on the CPU server, SmolLM2 answers the chat-template form of these tasks with one
  digit and stops). Per task: a warm-up request caches every document alone, then one greedy answer of
  each variant of :data:`VARIANTS` (``recompute`` = dense prefill of the concatenation, ``samkv``,
  ``reuse``, ``cacheblend``); exact match of the planted number (first number of the reply).
* **TTFT set** (``--tasks`` x ``--docs`` documents of ``--words`` words; default 6 x 8 x 760 words, ~960
  tokens each, 8 fill SmolLM2's 8k context): per task a warm-up, then the latency of a non-streaming
  chat request with ``max_tokens`` 1 (the documents API refuses streaming) of ``samkv`` (documents cached)
  and of ``recompute`` (a fresh namespace every time), median over ``--repeats`` fresh question wordings
  (no composite is reused), and the server-reported KV kept ratio of the samkv requests.

Headline (``samkv.json``, computed, each figure's set named under ``figure_sources``):
``ttft_ratio_vs_recompute`` = median samkv TTFT / median recompute TTFT (TTFT set), ``kv_kept_ratio`` =
mean server-reported kept ratio of the samkv requests (TTFT set), ``accuracy_delta_vs_recompute`` =
(samkv accuracy - recompute accuracy) in points (accuracy set). ``--smoke``: one tiny task per set,
for the CPU test. ``--launch`` starts the server (bench.server) and stops it by its process group.

    python -m bench.samkv_bench --launch --device cuda --model $KIT_MODEL --out bench/results \\
        --server-args "--attention-backend flashinfer --page-size 16"
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import signal
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
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


VARIANTS = ("recompute", "samkv", "reuse", "cacheblend")
ANSWER_PREFIX = "Answer: The answer is"  # generic (names neither person nor number), after T.ANSWER_PREFIX


@dataclass(frozen=True)
class SetSpec:
    """One task set: ``tasks`` tasks (0 = skip the set) of ``docs`` documents of ~``words`` words each."""

    tasks: int
    docs: int
    words: int

    def __post_init__(self):
        for name, lo in (("tasks", 0), ("docs", 1), ("words", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"SetSpec.{name}={v!r} must be an integer >= {lo}")


@dataclass(frozen=True)
class BenchPlan:
    """What one bench run measures: the accuracy set (every variant of ``variants`` answers each task with
    up to ``max_tokens`` greedy tokens), the TTFT set (``repeats`` timed samkv / recompute requests per
    task) and the variants (must hold ``recompute`` and ``samkv``: the headline compares them)."""

    accuracy: SetSpec = field(default_factory=lambda: SetSpec(60, 8, 400))
    ttft: SetSpec = field(default_factory=lambda: SetSpec(6, 8, 760))
    repeats: int = 3
    max_tokens: int = 16
    variants: tuple[str, ...] = VARIANTS

    def __post_init__(self):
        if not isinstance(self.accuracy, SetSpec) or not isinstance(self.ttft, SetSpec):
            raise ValueError("BenchPlan.accuracy / .ttft must be SetSpec")
        for name in ("repeats", "max_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"BenchPlan.{name}={v!r} must be an integer >= 1")
        bad = [v for v in self.variants if v not in VARIANTS]
        if bad or not {"recompute", "samkv"} <= set(self.variants):
            raise ValueError(f"BenchPlan.variants={self.variants!r}: a subset of {VARIANTS} holding recompute and samkv")
        if self.accuracy.tasks == 0 and self.ttft.tasks == 0:
            raise ValueError("BenchPlan: both task sets are empty")


SMOKE = BenchPlan(accuracy=SetSpec(1, 3, 40), ttft=SetSpec(1, 2, 80), repeats=1, max_tokens=8)


def ask(url: str, task: SamKVTask, variant: str | None, max_tokens: int, wording: int = 0, timeout: float = 900.0,
        salt: str | None = None, style: str = "chat") -> dict:
    """One documents request; returns ``{"latency_s", "text", "sparse"}`` (raises on HTTP errors).

    style ``chat``: ``/v1/chat/completions``, the question (wording ``wording``) + :data:`bench.tasks.TRAILER`
    as the user message; ``completion``: ``/v1/completions``, raw prompt ``Question: ...\nAnswer: The answer is``.
    """
    question = WORDINGS[wording % len(WORDINGS)].format(n=task.name)
    body = {"model": "default", "max_tokens": max_tokens, "temperature": 0, "documents": list(task.documents)}
    if variant is not None:  # None: the server picks (its variant, or recompute below min_document_tokens)
        body["samkv"] = {"variant": variant}
    if style == "chat":
        body["messages"] = [{"role": "user", "content": question + " " + T.TRAILER}]
        path = "/v1/chat/completions"
    elif style == "completion":
        body["prompt"] = f"Question: {question}\n{ANSWER_PREFIX}"
        path = "/v1/completions"
    else:
        raise ValueError(f"ask: style={style!r} must be 'chat' or 'completion'")
    if salt is not None:
        body["cache_salt"] = salt
    t0, w0 = time.perf_counter(), time.time()
    r = requests.post(url + path, json=body, timeout=timeout)
    dt, w1 = time.perf_counter() - t0, time.time()
    if r.status_code != 200:
        raise RuntimeError(f"{variant}: HTTP {r.status_code}: {r.text[:500]}")
    j = r.json()
    c = j["choices"][0]
    text = (c["message"]["content"] if "message" in c else c.get("text")) or ""
    return {"latency_s": dt, "text": text, "sparse": (j.get("metadata") or {}).get("sparse") or {}, "wall_s": [w0, w1]}


def split_latency(reply: dict) -> dict | None:
    """A reply's latency around the scheduler's assembly (same host, wall clocks): ms from sending to the
    assembly's start, of the assembly, and from its end to the reply (None without the server's span)."""
    span = reply["sparse"].get("scheduler_wall_s")
    if not span:
        return None
    (w0, w1), (a0, a1) = reply["wall_s"], span
    return {"before_ms": round(1000 * (a0 - w0), 3), "assembly_ms": round(1000 * (a1 - a0), 3),
            "after_ms": round(1000 * (w1 - a1), 3)}


def correct(text: str, answer: str) -> bool:
    from bench.scoring import extract_numbers

    nums = extract_numbers(text)
    return bool(nums) and nums[0] == answer


def fact_kept(tokenizer, task: SamKVTask, kept_ranges) -> bool | None:
    """Whether every token of the planted fact lies in the kept ranges the server reported for the needed
    document (``metadata.sparse.kept_ranges``: flat ``[start, end, ...]`` in the document's ids, which inside the
    document, where the fact lies, equal ``tok(document + "\n\n")``'s); None without a tokenizer (``--url`` runs)
    or ranges (no assembly)."""
    if tokenizer is None or not kept_ranges or task.needed_doc >= len(kept_ranges):
        return None
    text = task.documents[task.needed_doc] + "\n\n"  # sglang_sparse.samkv.api.SEPARATOR
    fact = T._fact(task.name, task.answer)
    c0 = text.index(fact)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    toks = [i for i, (a, b) in enumerate(enc["offset_mapping"]) if b > c0 and a < c0 + len(fact)]
    r = kept_ranges[task.needed_doc]
    return all(any(lo <= i < hi for lo, hi in zip(r[::2], r[1::2])) for i in toks)


def load_tokenizer(model: str | None):
    """The model folder's HF tokenizer (the server's own files), or None."""
    if not model:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def _mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def run_accuracy(url: str, spec: SetSpec, variants: tuple[str, ...], max_tokens: int, log=print,
                 tokenizer=None) -> dict:
    """The accuracy set: per task a warm-up (documents cached alone), then one greedy answer per variant;
    with ``tokenizer``, whether samkv kept the fact's tokens (``fact_kept``)."""
    rows = []
    for seed in range(spec.tasks):
        task = make_task(seed, spec.docs, spec.words)
        warm = ask(url, task, "samkv", 1, wording=len(WORDINGS) - 1, style="completion")
        answers = {v: ask(url, task, v, max_tokens, style="completion") for v in variants}
        row = {"task": task.tid, "answer": task.answer, "needed_doc": task.needed_doc,
               "document_tokens": warm["sparse"].get("document_tokens"),
               "correct": {v: correct(a["text"], task.answer) for v, a in answers.items()},
               "replies": {v: a["text"] for v, a in answers.items()},
               "kv_kept_ratio": answers["samkv"]["sparse"].get("kv_kept_ratio"),
               "fact_kept": fact_kept(tokenizer, task, answers["samkv"]["sparse"].get("kept_ranges")),
               "recomputed_tokens": {v: answers[v]["sparse"].get("recomputed_tokens") for v in variants},
               "metadata": {v: a["sparse"] for v, a in answers.items()}}
        log(f"[samkv_bench] accuracy {task.tid}: tokens={row['document_tokens']} correct={row['correct']} "
            f"kept={row['kv_kept_ratio']} fact_kept={row['fact_kept']}")
        rows.append(row)
    acc = {v: sum(r["correct"][v] for r in rows) / len(rows) for v in variants} if rows else {}
    known = [r for r in rows if r["fact_kept"] is not None]
    facts = ({"tasks": len(known), "kept": sum(r["fact_kept"] for r in known),
              "samkv_misses": sum(not r["correct"]["samkv"] for r in known),
              "samkv_misses_with_fact_dropped": sum(not r["correct"]["samkv"] and not r["fact_kept"] for r in known)}
             if known else None)
    return {"spec": asdict(spec), "rows": rows, "accuracy": acc, "fact_kept": facts,
            "delta_vs_recompute_points": {v: 100.0 * (acc[v] - acc["recompute"]) for v in acc},
            "kv_kept_ratio": _mean(r["kv_kept_ratio"] for r in rows)}


def run_ttft(url: str, spec: SetSpec, repeats: int, log=print) -> dict:
    """The TTFT set: per task a warm-up, then ``repeats`` timed recompute / samkv requests (max_tokens 1)."""
    rows = []
    for seed in range(spec.tasks):
        task = make_task(seed, spec.docs, spec.words)
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
                                   "scheduler_ms": r["sparse"].get("scheduler_ms"), "wall_ms": split_latency(r)})
        row = {"task": task.tid, "needed_doc": task.needed_doc, "document_tokens": warm["sparse"].get("document_tokens"),
               "warm_documents_prefilled": warm["sparse"].get("documents_prefilled"),
               "ttft_s": {v: statistics.median(x) for v, x in ttft.items()},
               "kv_kept_ratio": _mean(kept), "samkv_timing_ms": phases}
        log(f"[samkv_bench] ttft {task.tid}: tokens={row['document_tokens']} ttft={row['ttft_s']} "
            f"kept={row['kv_kept_ratio']} last samkv timing={phases[-1] if phases else None}")
        rows.append(row)
    med = {v: statistics.median(r["ttft_s"][v] for r in rows) for v in ("samkv", "recompute")} if rows else None
    return {"spec": asdict(spec), "rows": rows, "ttft_median_s": med,
            "ttft_ratio_vs_recompute": med["samkv"] / med["recompute"] if med else None,
            "kv_kept_ratio": _mean(r["kv_kept_ratio"] for r in rows)}


def run(url: str, plan: BenchPlan = BenchPlan(), log=print, tokenizer=None) -> dict:
    """Both task sets of ``plan`` against one server; the headline figures computed from them, each with
    its source set under ``figure_sources``. ``tokenizer``: the server's, for the accuracy set's ``fact_kept``."""
    acc = (run_accuracy(url, plan.accuracy, plan.variants, plan.max_tokens, log, tokenizer=tokenizer)
           if plan.accuracy.tasks else None)
    tt = run_ttft(url, plan.ttft, plan.repeats, log) if plan.ttft.tasks else None

    def where(s: SetSpec) -> str:
        return f"{s.tasks} tasks x {s.docs} documents of ~{s.words} words"

    return {"plan": asdict(plan), "accuracy_set": acc, "ttft_set": tt,
            "ttft_ratio_vs_recompute": tt["ttft_ratio_vs_recompute"] if tt else None,
            "ttft_median_s": tt["ttft_median_s"] if tt else None,
            "kv_kept_ratio": tt["kv_kept_ratio"] if tt else (acc or {}).get("kv_kept_ratio"),
            "accuracy": acc["accuracy"] if acc else None,
            "accuracy_delta_vs_recompute": acc["delta_vs_recompute_points"]["samkv"] if acc else None,
            "figure_sources": {
                "ttft_ratio_vs_recompute": f"TTFT set ({where(plan.ttft)})" if tt else None,
                "kv_kept_ratio": (f"TTFT set ({where(plan.ttft)})" if tt else
                                  f"accuracy set ({where(plan.accuracy)})" if acc else None),
                "accuracy_delta_vs_recompute": f"accuracy set ({where(plan.accuracy)})" if acc else None}}


def _gpu_name() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:
        pass
    return "none (CPU run)"


def write_report(out: Path, res: dict, facts: dict) -> None:
    """``samkv.json`` (headline keys + ``figure_sources`` + every row under ``details``) and ``samkv.md``."""
    out.mkdir(parents=True, exist_ok=True)
    head = {"gpu": facts["gpu"], "model": facts.get("model"), "weights": facts.get("weights", "real"),
            "ttft_ratio_vs_recompute": res["ttft_ratio_vs_recompute"], "ttft_median_s": res["ttft_median_s"],
            "kv_kept_ratio": res["kv_kept_ratio"], "accuracy_delta_vs_recompute": res["accuracy_delta_vs_recompute"],
            "accuracy": res["accuracy"], "figure_sources": res["figure_sources"]}
    (out / "samkv.json").write_text(json.dumps({**head, "details": {**facts, **res}}, indent=1))
    f3 = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
    src = res["figure_sources"]
    acc, tt = res["accuracy_set"], res["ttft_set"]
    lines = ["# SamKV: per-document KV reuse + block selection (`--sparse samkv`)", "",
             f"- model: {facts.get('model')} ({facts.get('weights', 'real')} weights)",
             f"- command: `{facts['command']}`", f"- GPU: {facts['gpu']}", f"- server: {facts.get('server', '?')}"]
    if acc:
        lines.append(f"- {src['accuracy_delta_vs_recompute']} (document tokens per task: "
                     f"{[r['document_tokens'] for r in acc['rows']]})")
    if tt:
        lines.append(f"- {src['ttft_ratio_vs_recompute']} (document tokens per task: "
                     f"{[r['document_tokens'] for r in tt['rows']]})")
    lines += ["", "| figure | value | from |", "|---|---|---|",
              f"| TTFT samkv / full recompute (median, docs cached) | {f3(res['ttft_ratio_vs_recompute'])} | "
              f"{src['ttft_ratio_vs_recompute']} |"]
    if tt:
        lines.append(f"| TTFT median samkv / recompute (s) | {tt['ttft_median_s']['samkv']:.4f} / "
                     f"{tt['ttft_median_s']['recompute']:.4f} | {src['ttft_ratio_vs_recompute']} |")
    lines.append(f"| KV kept ratio (samkv) | {f3(res['kv_kept_ratio'])} | {src['kv_kept_ratio']} |")
    if acc:
        vs = list(acc["accuracy"])
        lines += [f"| accuracy {' / '.join(vs)} | {' / '.join(f3(acc['accuracy'][v]) for v in vs)} | "
                  f"{src['accuracy_delta_vs_recompute']} |",
                  f"| accuracy delta vs recompute (points) {' / '.join(vs[1:])} | "
                  f"{' / '.join(format(acc['delta_vs_recompute_points'][v], '+.1f') for v in vs[1:])} | "
                  f"{src['accuracy_delta_vs_recompute']} |",
                  f"| KV kept ratio (samkv) on the accuracy set | {f3(acc['kv_kept_ratio'])} | "
                  f"{src['accuracy_delta_vs_recompute']} |"]
        fk = acc.get("fact_kept")
        if fk:
            lines.append(f"| samkv kept the fact's tokens / misses with the fact dropped | {fk['kept']} of {fk['tasks']} "
                         f"/ {fk['samkv_misses_with_fact_dropped']} of {fk['samkv_misses']} | "
                         f"{src['accuracy_delta_vs_recompute']} |")
    else:
        lines.append("| accuracy | n/a (no accuracy set in this run) | |")
    lines += ["", "TTFT = latency of a non-streaming chat request with max_tokens 1 (documents cached and known to "
              "the front door). samkv = reuse + SamKV block selection + selective recompute (server config); reuse = "
              "every block, no recompute; cacheblend = every block + selective recompute; recompute = dense prefill "
              "of the concatenation. Accuracy = exact match of the planted number (first number of a greedy "
              "completion after `Question: ...\\nAnswer: The answer is`)."]
    if acc:
        vs = list(acc["accuracy"])
        lines += ["", "Accuracy set:", "", "| task | answer | " + " | ".join(vs) + " | kept | fact kept |",
                  "|---" * (len(vs) + 4) + "|"]
        for r in acc["rows"]:
            cells = [("ok " if r["correct"][v] else "") + repr(r["replies"][v][:40]) for v in vs]
            fk = {True: "yes", False: "**no**", None: "?"}[r.get("fact_kept")]
            lines.append(f"| {r['task']} | {r['answer']} | " + " | ".join(cells) + f" | {f3(r['kv_kept_ratio'])} | {fk} |")
    if tt:
        lines += ["", "TTFT set:", "", "| task | document tokens | TTFT samkv (s) | TTFT recompute (s) | kept |",
                  "|---|---|---|---|---|"]
        for r in tt["rows"]:
            lines.append(f"| {r['task']} | {r['document_tokens']} | {r['ttft_s']['samkv']:.4f} | "
                         f"{r['ttft_s']['recompute']:.4f} | {f3(r['kv_kept_ratio'])} |")
        last = [t for r in tt["rows"] for t in r.get("samkv_timing_ms", [])]
        if last:
            lines += ["", "Where a samkv request's time went (TTFT set, last timed request, ms; front door phases "
                      "and the scheduler's CUDA-synchronised assembly phases):", "", f"`{json.dumps(last[-1])}`"]
    (out / "samkv.md").write_text("\n".join(lines) + "\n")


def add_to_headline(path: Path, res: dict, facts: dict, source: Path, headline_ttft: bool = False) -> None:
    """Record this run's TTFT figures (computed above) under ``ttft_by_model[<model label>]`` of ``path``;
    ``headline_ttft``: this run's TTFT ratio becomes the headline ``ttft_ratio_vs_recompute`` too (its set, model and
    weights named under ``figure_sources``; the headline's own model keeps its entry under ``ttft_by_model``)."""
    if res["ttft_set"] is None:
        return
    head = json.loads(path.read_text()) if path.exists() else {}
    head.setdefault("ttft_by_model", {})[facts["model"]] = {
        "weights": facts["weights"], "gpu": facts["gpu"], "ttft_ratio_vs_recompute": res["ttft_ratio_vs_recompute"],
        "ttft_median_s": res["ttft_median_s"], "kv_kept_ratio": res["ttft_set"]["kv_kept_ratio"],
        "document_tokens": [r["document_tokens"] for r in res["ttft_set"]["rows"]],
        "tasks": len(res["ttft_set"]["rows"]), "source": str(source)}
    if headline_ttft:
        head["ttft_ratio_vs_recompute"] = res["ttft_ratio_vs_recompute"]
        head["ttft_median_s"] = res["ttft_median_s"]
        head.setdefault("figure_sources", {})["ttft_ratio_vs_recompute"] = (
            f"{res['figure_sources']['ttft_ratio_vs_recompute']}, {facts['model']}, {facts['weights']} weights")
    path.write_text(json.dumps(head, indent=1))


def merge_report(report: Path, headline: Path, headline_ttft: bool) -> None:
    """:func:`add_to_headline` from a finished run's ``samkv.json`` (its ``details``), without running anything."""
    details = json.loads(report.read_text())["details"]
    add_to_headline(headline, details, details, report, headline_ttft=headline_ttft)


def _sigterm(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    from bench.server import add_target_args

    add_target_args(ap, port=30010, mode="samkv")
    d = BenchPlan()
    ap.add_argument("--tasks", type=int, default=d.ttft.tasks, help="TTFT set: tasks (0 = no TTFT set)")
    ap.add_argument("--docs", type=int, default=d.ttft.docs, help="TTFT set: documents per task")
    ap.add_argument("--words", type=int, default=d.ttft.words, help="TTFT set: words per document (~960 tokens "
                    "of this text: 8 fit the 8k context of SmolLM2)")
    ap.add_argument("--acc-tasks", type=int, default=d.accuracy.tasks, help="accuracy set: tasks (0 = none)")
    ap.add_argument("--acc-docs", type=int, default=d.accuracy.docs, help="accuracy set: documents per task")
    ap.add_argument("--acc-words", type=int, default=d.accuracy.words, help="accuracy set: words per document")
    ap.add_argument("--repeats", type=int, default=d.repeats)
    ap.add_argument("--max-tokens", type=int, default=d.max_tokens)
    ap.add_argument("--variants", default=",".join(d.variants), help="accuracy set: comma-separated variants to ask "
                    f"(a subset of {','.join(VARIANTS)} holding recompute and samkv)")
    ap.add_argument("--smoke", action="store_true", help="one tiny task per set, 1 repeat (CPU test); overrides "
                    "the set sizes")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--ttft-only", action="store_true", help="no accuracy set (dummy-weight runs)")
    ap.add_argument("--dummy-8b", metavar="DIR", help="build a Llama-3.1-8B-shaped folder in DIR from --model's "
                    "tokenizer (bench.dummy_model), serve it with --load-format dummy; implies --ttft-only")
    ap.add_argument("--headline", metavar="JSON", help="also add this run's TTFT figures, with their model and "
                    "weights, under 'ttft_by_model' of this samkv.json (the real-model run's headline)")
    ap.add_argument("--headline-ttft", action="store_true", help="with --headline: this run's TTFT ratio becomes the "
                    "headline's ttft_ratio_vs_recompute (the set the issue specifies, 8 documents of 1-2k tokens, "
                    "does not fit SmolLM2's 8k context; the 8B-shape run has it), its source named")
    ap.add_argument("--merge-report", metavar="SAMKV_JSON", help="merge a finished run's samkv.json into --headline "
                    "(as that run would have with --headline) and exit; runs nothing")
    a = ap.parse_args(argv)
    if a.merge_report:
        if not a.headline:
            ap.error("--merge-report needs --headline")
        merge_report(Path(a.merge_report), Path(a.headline), a.headline_ttft)
        return 0
    weights, model_label = "real", a.model
    if a.dummy_8b:
        from bench.dummy_model import LABEL, make_dummy_llama8b

        a.model = str(make_dummy_llama8b(a.model, a.dummy_8b))
        a.server_args = (a.server_args + " --load-format dummy").strip()
        a.ttft_only, weights, model_label = True, "dummy", LABEL
    if a.smoke:
        plan = SMOKE
    else:
        try:
            plan = BenchPlan(accuracy=SetSpec(a.acc_tasks, a.acc_docs, a.acc_words),
                             ttft=SetSpec(a.tasks, a.docs, a.words), repeats=a.repeats, max_tokens=a.max_tokens,
                             variants=tuple(v.strip() for v in a.variants.split(",") if v.strip()))
        except ValueError as e:
            ap.error(str(e))
    if a.ttft_only:
        plan = BenchPlan(accuracy=SetSpec(0, plan.accuracy.docs, plan.accuracy.words), ttft=plan.ttft,
                         repeats=plan.repeats, max_tokens=plan.max_tokens, variants=plan.variants)
    facts = {"command": " ".join(shlex.quote(x) for x in [sys.executable, "-m", "bench.samkv_bench"] + (argv or sys.argv[1:])),
             "gpu": _gpu_name() if a.device == "cuda" else "none (CPU run)", "model": model_label, "weights": weights}
    server = None
    url = a.url
    # `timeout` sends SIGTERM: unwind through the finally below, which stops the launched server by its process
    # group (else a killed bench leaves its 8B server holding the GPU)
    signal.signal(signal.SIGTERM, _sigterm)
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
        res = run(url, plan, tokenizer=None if a.dummy_8b or plan.accuracy.tasks == 0 else load_tokenizer(a.model))
    finally:
        if server is not None:
            server.stop()
    write_report(Path(a.out), res, facts)
    add_to_headline(Path(a.out) / "samkv.json", res, facts, Path(a.out) / "samkv.json")
    if a.headline:
        add_to_headline(Path(a.headline), res, facts, Path(a.out) / "samkv.json", headline_ttft=a.headline_ttft)
    print(json.dumps({k: res[k] for k in ("ttft_ratio_vs_recompute", "kv_kept_ratio", "accuracy_delta_vs_recompute",
                                          "accuracy", "ttft_median_s", "figure_sources")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
