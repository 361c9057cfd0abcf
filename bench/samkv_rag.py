"""SamKV against the stock inline prompt on the testbed's RAG tasks: accuracy of every variant, TTFT at 8 x 3k.

One ``--sparse samkv`` server answers both kinds of request: a plain chat request is SGLang's stock path, a
request with ``documents`` goes through SamKV. So the baseline and the variants run on the same weights,
kernels and server.

* **Accuracy set**: the ``long`` preset's RAG tasks (:func:`bench.tasks_long.make_rag`: 4 / 8 / 16 documents of
  0.5k-4k tokens, one of them holding the asked fact). Each task is asked
  * ``stock_inline``: documents inlined in the user message (the stock prompt a chat client sends);
  * through the documents API, once per variant: ``recompute`` (dense prefill of the composite), ``samkv``
    (the default: selection + partial recompute), ``reuse`` and ``cacheblend``.
  Greedy, the system prompt and answer prefix of the harness, scored as the harness scores
  (:func:`bench.scoring.task_scores`). Reported per variant and per document count, with the paired difference
  against ``stock_inline`` in points and its 95 % interval.
* **TTFT set** (``--ttft-tasks`` tasks of ``--ttft-docs`` documents x ``--ttft-doc-tokens`` tokens): a warm-up
  request caches the documents; then per repeat, ``max_tokens`` 1, non-streaming:
  * ``samkv``: the documents API, documents cached, a fresh question (a repeat number in front of it), so the
    composite is assembled every time;
  * ``stock_inline``: the same documents inlined, behind a per-repeat tag at the start of the user message,
    so only the system prompt and the turn header come from SGLang's prefix cache (what it caches anyway);
  * ``recompute``: the documents API with a dense prefill of the composite.
  Medians over repeats and tasks; the server's phase times of the samkv requests (``metadata.sparse``:
  ``front_ms``, ``scheduler_ms``) are kept per request.

``--headline samkv.json`` adds ``baseline``, ``accuracy_delta_vs_stock_inline`` and ``ttft_ratio_vs_stock_inline``
(with their sources) to an existing headline. ``--launch`` starts the server (bench.server) and stops it.

    python -m bench.samkv_rag --launch --model models/SmolLM2-135M-Instruct-32k --device cuda \\
        --server-args "--attention-backend flashinfer" --out bench/results --headline bench/results/samkv.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import requests

from bench import envinfo, scoring
from bench import tasks_long as TL

VARIANTS = ("recompute", "samkv", "reuse", "cacheblend")
BASELINE = "stock_inline"


@dataclass(frozen=True)
class RagPlan:
    """What one run measures. ``docs``: document counts of the accuracy set; ``tasks``: tasks per count;
    ``positions``: where the question sits in the stock prompt (``end`` = after the documents, as the documents
    API places it); TTFT set: ``ttft_tasks`` x ``ttft_docs`` documents of ``ttft_doc_tokens`` tokens."""

    docs: tuple[int, ...] = (4, 8, 16)
    tasks: int = 20
    positions: tuple[str, ...] = ("end",)
    variants: tuple[str, ...] = VARIANTS
    max_tokens: int = 24
    concurrency: int = 4
    ttft_tasks: int = 3
    ttft_docs: int = 8
    ttft_doc_tokens: int = 3000
    repeats: int = 3
    doc_tokens: tuple[int, int] | None = None  # None: the preset's 0.5k-4k sizes

    def __post_init__(self):
        for name in ("tasks", "max_tokens", "concurrency", "repeats", "ttft_docs", "ttft_doc_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"RagPlan.{name}={v!r} must be an integer >= 1")
        if isinstance(self.ttft_tasks, bool) or not isinstance(self.ttft_tasks, int) or self.ttft_tasks < 0:
            raise ValueError(f"RagPlan.ttft_tasks={self.ttft_tasks!r} must be an integer >= 0")
        if not self.docs or any(not isinstance(d, int) or d < 2 for d in self.docs):
            raise ValueError(f"RagPlan.docs={self.docs!r} must be document counts >= 2")
        bad = [p for p in self.positions if p not in TL.DEPTHS]
        if not self.positions or bad:
            raise ValueError(f"RagPlan.positions={self.positions!r} must be a non-empty subset of {tuple(TL.DEPTHS)}")
        if not self.variants or set(self.variants) - set(VARIANTS):
            raise ValueError(f"RagPlan.variants={self.variants!r} must be a non-empty subset of {VARIANTS}")


SMOKE = RagPlan(docs=(2,), tasks=1, variants=("recompute", "samkv"), max_tokens=12, concurrency=1, ttft_tasks=1,
                ttft_docs=2, ttft_doc_tokens=120, repeats=1, doc_tokens=(100, 140))


def _messages(task, user: str) -> list[dict]:
    msgs = [{"role": "system", "content": task.system}, {"role": "user", "content": user}]
    if task.answer_prefix:
        msgs.append({"role": "assistant", "content": task.answer_prefix})
    return msgs


def ask(url: str, task, how: str, max_tokens: int, tag: str = "", timeout: float = 900.0) -> dict:
    """One request of ``task``: ``how`` = ``stock_inline`` or a SamKV variant. ``tag``: text in front of the
    user message (inline) or of the question (documents API), to make a request's prompt new.
    Returns ``{"reply", "latency_s", "sparse", "prompt_tokens", "cached_tokens"}``; raises on HTTP errors."""
    if how == BASELINE:
        user = (tag + "\n\n" if tag else "") + task.turns[0].user
        body = {"messages": _messages(task, user)}
    else:
        body = {"messages": _messages(task, (tag + " " if tag else "") + task.meta["question"]),
                "documents": list(task.meta["documents"]), "samkv": {"variant": how}}
    body.update({"model": "default", "temperature": 0.0, "max_tokens": max_tokens, "return_meta_info": True})
    if task.answer_prefix:
        body["continue_final_message"] = True
    t0 = time.perf_counter()
    r = requests.post(url + "/v1/chat/completions", json=body, timeout=timeout)
    dt = time.perf_counter() - t0
    if r.status_code != 200:
        raise RuntimeError(f"{task.task_id} {how}: HTTP {r.status_code}: {r.text[:400]}")
    j = r.json()
    c = j["choices"][0]
    meta = c.get("meta_info") or {}
    usage = j.get("usage") or {}
    return {"reply": c["message"]["content"] or "", "latency_s": dt,
            "sparse": meta.get("sparse") or (j.get("metadata") or {}).get("sparse") or {},
            "prompt_tokens": usage.get("prompt_tokens"), "cached_tokens": meta.get("cached_tokens")}


def _ci95_points(diffs: list[float]) -> list[float] | None:
    if len(diffs) < 2:
        return None
    m, s = statistics.fmean(diffs), statistics.stdev(diffs)
    half = 1.96 * s / len(diffs) ** 0.5
    return [round(100 * (m - half), 2), round(100 * (m + half), 2)]


def accuracy_tasks(plan: RagPlan, seed: int = 0) -> list:
    return [TL.make_rag(pos, n, seed * 1000 + i, plan.doc_tokens)
            for n in plan.docs for pos in plan.positions for i in range(plan.tasks)]


def run_accuracy(url: str, plan: RagPlan, log=print, time_budget: float | None = None) -> dict:
    """Every task of the accuracy set, asked inline and through each variant (tasks run ``concurrency`` at a
    time; one task's requests in sequence)."""
    tasks = accuracy_tasks(plan)
    hows = (BASELINE,) + plan.variants
    t0 = time.time()

    def one(task):
        if time_budget is not None and time.time() - t0 > time_budget:
            return None
        turn = task.turns[0]
        row = {"task": task.task_id, "docs": task.meta["docs"], "position": task.position,
               "doc_tokens": sum(task.meta["doc_tokens"]), "score": {}, "reply": {}, "kv_kept_ratio": None}
        for how in hows:
            a = ask(url, task, how, plan.max_tokens)
            row["score"][how] = scoring.task_scores(a["reply"], turn.answers, turn.metric)["score"]
            row["reply"][how] = a["reply"]
            if how == "samkv":
                row["kv_kept_ratio"] = a["sparse"].get("kv_kept_ratio")
                row["samkv_status"] = a["sparse"].get("scheduler_status")
        return row

    rows, done = [], 0
    with ThreadPoolExecutor(plan.concurrency) as pool:
        for row in pool.map(one, tasks):
            done += 1
            if row is not None:
                rows.append(row)
            if done % 10 == 0 or done == len(tasks):
                log(f"[samkv_rag] accuracy {done}/{len(tasks)} tasks in {time.time() - t0:.0f}s")
    return summarize_accuracy(rows, hows)


def summarize_accuracy(rows: list[dict], hows: tuple[str, ...]) -> dict:
    """Accuracy per variant (all tasks and per document count) and the paired difference against the inline
    baseline in points with its 95 % interval (over all tasks, and per document count)."""
    def acc(rs, how):
        return statistics.fmean(r["score"][how] for r in rs) if rs else None

    by_docs = {}
    for n in sorted({r["docs"] for r in rows}):
        rs = [r for r in rows if r["docs"] == n]
        by_docs[str(n)] = {"n": len(rs), **{h: acc(rs, h) for h in hows},
                           "delta_ci95_points": {h: _ci95_points([r["score"][h] - r["score"][BASELINE] for r in rs])
                                                 for h in hows[1:]}}
    out = {"n": len(rows), "accuracy": {h: acc(rows, h) for h in hows}, "accuracy_by_docs": by_docs,
           "delta_vs_stock_inline_points": {}, "delta_ci95_points": {},
           "kv_kept_ratio": statistics.fmean(r["kv_kept_ratio"] for r in rows if r["kv_kept_ratio"] is not None)
           if any(r["kv_kept_ratio"] is not None for r in rows) else None, "rows": rows}
    for h in hows[1:]:
        diffs = [r["score"][h] - r["score"][BASELINE] for r in rows]
        out["delta_vs_stock_inline_points"][h] = round(100 * statistics.fmean(diffs), 2) if diffs else None
        out["delta_ci95_points"][h] = _ci95_points(diffs)
    return out


def run_ttft(url: str, plan: RagPlan, log=print) -> dict | None:
    """The TTFT set (see the module docstring)."""
    if plan.ttft_tasks == 0:
        return None
    rows = []
    tok = (plan.ttft_doc_tokens, plan.ttft_doc_tokens)
    for i in range(plan.ttft_tasks):
        task = TL.make_rag("end", plan.ttft_docs, 7000 + i, tok)
        warm = ask(url, task, "samkv", 1, tag="(warm-up)")
        lat = {"samkv": [], BASELINE: [], "recompute": []}
        phases = []
        for rep in range(plan.repeats):
            for how in ("samkv", BASELINE, "recompute"):
                a = ask(url, task, how, 1, tag=f"({time.time_ns()} {rep})")
                lat[how].append(a["latency_s"])
                if how == "samkv":
                    s = a["sparse"]
                    phases.append({k: s.get(k) for k in ("scheduler_status", "kv_kept_ratio", "front_ms", "scheduler_ms")})
                if how == BASELINE:
                    phases[-1]["stock_inline_cached_tokens"] = a["cached_tokens"]
                    phases[-1]["stock_inline_prompt_tokens"] = a["prompt_tokens"]
        row = {"task": task.task_id, "document_tokens": warm["sparse"].get("document_tokens"),
               "ttft_s": {h: statistics.median(v) for h, v in lat.items()}, "samkv_phases": phases}
        log(f"[samkv_rag] ttft {task.task_id}: {row['ttft_s']} last={phases[-1]}")
        rows.append(row)
    med = {h: statistics.median(r["ttft_s"][h] for r in rows) for h in ("samkv", BASELINE, "recompute")}
    return {"rows": rows, "ttft_median_s": med, "ttft_ratio_vs_stock_inline": med["samkv"] / med[BASELINE],
            "recompute_ratio_vs_stock_inline": med["recompute"] / med[BASELINE]}


def merge_headline(path: Path, res: dict, plan: RagPlan) -> dict:
    """Add the stock-inline keys to an existing ``samkv.json`` headline (kept keys untouched otherwise)."""
    head = json.loads(path.read_text()) if path.exists() else {}
    acc, tt = res.get("accuracy_set"), res.get("ttft_set")
    head["baseline"] = BASELINE
    if acc:
        head["accuracy_delta_vs_stock_inline"] = acc["delta_vs_stock_inline_points"].get("samkv")
        head["accuracy_vs_stock_inline"] = {"accuracy": acc["accuracy"], "delta_points": acc["delta_vs_stock_inline_points"],
                                            "delta_ci95_points": acc["delta_ci95_points"],
                                            "accuracy_by_docs": acc["accuracy_by_docs"],
                                            "kv_kept_ratio": acc["kv_kept_ratio"], "tasks": acc["n"]}
    if tt:
        head["ttft_ratio_vs_stock_inline"] = tt["ttft_ratio_vs_stock_inline"]
        head["ttft_vs_stock_inline_median_s"] = tt["ttft_median_s"]
    src = head.setdefault("figure_sources", {})
    src["accuracy_delta_vs_stock_inline"] = (f"bench.samkv_rag accuracy set: {acc['n']} RAG tasks of the long preset "
                                             f"({'/'.join(map(str, plan.docs))} documents), same server") if acc else None
    src["ttft_ratio_vs_stock_inline"] = (f"bench.samkv_rag TTFT set: {plan.ttft_tasks} tasks x {plan.ttft_docs} documents "
                                         f"x {plan.ttft_doc_tokens} tokens, documents cached") if tt else None
    path.write_text(json.dumps(head, indent=1))
    return head


def main(argv=None) -> int:
    d = RagPlan()
    ap = argparse.ArgumentParser(prog="python -m bench.samkv_rag", description=__doc__.split("\n\n")[0])
    from bench.server import add_target_args

    add_target_args(ap, port=30020, mode="samkv")
    ap.add_argument("--docs", default=",".join(map(str, d.docs)), help="accuracy set: document counts")
    ap.add_argument("--tasks", type=int, default=d.tasks, help="accuracy set: tasks per document count and position")
    ap.add_argument("--positions", default=",".join(d.positions))
    ap.add_argument("--variants", default=",".join(d.variants))
    ap.add_argument("--concurrency", type=int, default=d.concurrency)
    ap.add_argument("--ttft-tasks", type=int, default=d.ttft_tasks, help="TTFT set: tasks (0 = none)")
    ap.add_argument("--ttft-docs", type=int, default=d.ttft_docs)
    ap.add_argument("--ttft-doc-tokens", type=int, default=d.ttft_doc_tokens)
    ap.add_argument("--repeats", type=int, default=d.repeats)
    ap.add_argument("--time-budget", type=float, default=None, help="accuracy set: stop starting tasks after S s")
    ap.add_argument("--smoke", action="store_true", help="one tiny task per set (CPU test)")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--headline", metavar="JSON", help="add the stock-inline keys to this samkv.json")
    a = ap.parse_args(argv)
    try:
        plan = SMOKE if a.smoke else RagPlan(
            docs=tuple(int(x) for x in a.docs.split(",")), tasks=a.tasks, positions=tuple(a.positions.split(",")),
            variants=tuple(a.variants.split(",")), concurrency=a.concurrency, ttft_tasks=a.ttft_tasks,
            ttft_docs=a.ttft_docs, ttft_doc_tokens=a.ttft_doc_tokens, repeats=a.repeats)
    except ValueError as e:
        ap.error(str(e))
    if bool(a.url) == bool(a.launch):
        ap.error("give exactly one of --url or --launch")
    server = None
    if a.launch:
        if not a.model:
            ap.error("--launch needs --model")
        from bench.server import Server, ServerSpec

        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        spec = ServerSpec(python=a.python, model=a.model, device=a.device, port=a.port, mode="samkv",
                          sparse_config=a.sparse_config, extra_args=shlex.split(a.server_args))
        server = Server(spec, out / "samkv_rag_server.log", timeout_s=900).start()
        url = server.url
    else:
        url = a.url.rstrip("/")
    try:
        t0 = time.time()
        acc = run_accuracy(url, plan, time_budget=a.time_budget)
        tt = run_ttft(url, plan)
        env = envinfo.collect(a.python, [sys.executable, "-m", "bench.samkv_rag"] + list(argv or sys.argv[1:]))
        res = {"plan": asdict(plan), "command": env["command"], "env": env,
               "model": a.model, "wall_s": round(time.time() - t0, 1), "accuracy_set": acc, "ttft_set": tt}
    finally:
        if server is not None:
            server.stop()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "samkv_rag.json").write_text(json.dumps(res, indent=1))
    print(json.dumps({"accuracy": acc["accuracy"], "delta_points": acc["delta_vs_stock_inline_points"],
                      "ttft": tt and tt["ttft_median_s"], "ttft_ratio_vs_stock_inline": tt and tt["ttft_ratio_vs_stock_inline"]}))
    if a.headline:
        merge_headline(Path(a.headline), res, plan)
    return 0


if __name__ == "__main__":
    sys.exit(main())
