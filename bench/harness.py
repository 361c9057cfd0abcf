"""Run the task suite and the fidelity probes against one live server.

Produces, for one mode, a JSON-able record: every turn's reply and timings, the
fidelity probes' greedy output ids and teacher-forced top-k logprobs. Comparison with
dense happens later (:mod:`bench.report`), so a mode's raw record stands on its own.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor, as_completed

from bench import client, scoring
from bench.tasks import Preset, Task

PROGRESS_EVERY_S = 15.0


def _one_task(base_url: str, task: Task, model: str, max_tokens: int, timeout: float,
              documents_api: bool = False) -> dict:
    try:
        turns = client.run_conversation(base_url, task, model, max_tokens, timeout, documents_api)
        err = None
    except client.RequestError as e:
        turns, err = [], str(e)
    for rec, turn in zip(turns, task.turns):
        rec.update(scoring.task_scores(rec["reply"], turn.answers, turn.metric))
        rec.update({"answers": list(turn.answers), "position": turn.position,
                    "sources": list(turn.sources), "metric": turn.metric})
    return {"task_id": task.task_id, "kind": task.kind, "position": task.position,
            "words": task.words, "docs": task.meta.get("docs", 0), "tokens": task.meta.get("tokens"),
            "depth": task.meta.get("depth"), "turns": turns, "error": err}


def run_tasks(base_url: str, tasks: list[Task], model: str, max_tokens: int, log=print,
              timeout: float = 600.0, concurrency: int = 1, documents_api: bool = False,
              time_budget_s: float | None = None) -> list[dict]:
    """Play every task as a real multi-turn conversation and score every turn.

    ``concurrency`` > 1 plays that many conversations at once (turns within one
    conversation stay sequential); results keep the task order. ``documents_api``: see
    :func:`bench.client.run_conversation`. ``time_budget_s``: tasks not started within it are
    skipped (left out of the result, logged), so a slow mode still returns what it finished.
    """
    rows: list = [None] * len(tasks)
    t0 = last = time.monotonic()
    deadline = None if time_budget_s is None else t0 + time_budget_s
    done = 0

    def task_or_skip(t: Task):
        if deadline is not None and time.monotonic() > deadline:
            return None
        return _one_task(base_url, t, model, max_tokens, timeout, documents_api)

    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        futs = {pool.submit(task_or_skip, t): i for i, t in enumerate(tasks)}
        for fut in as_completed(futs):
            rows[futs[fut]] = fut.result()
            done += 1
            now = time.monotonic()
            if now - last > PROGRESS_EVERY_S or done == len(tasks):
                ok = [r for r in rows if r and r["turns"]]
                acc = sum(r["turns"][-1]["score"] for r in ok) / max(1, len(ok))
                errs = sum(1 for r in rows if r and r["error"])
                log(f"[tasks] {done}/{len(tasks)} done in {now - t0:.0f}s, last-turn score so far {acc:.2f}, "
                    f"{errs} failed")
                last = now
    skipped = sum(1 for r in rows if r is None)
    if skipped:
        log(f"[tasks] time budget {time_budget_s:.0f}s reached: {skipped} of {len(tasks)} tasks not run")
    return [r for r in rows if r is not None]


def run_fidelity(base_url: str, pairs: list[tuple[list[int], list[int]]], log=print,
                 timeout: float = 600.0) -> list[dict]:
    """For each (context ids, continuation ids): a 128-token greedy continuation and the
    teacher-forced top-k logprobs over the real continuation. Sequential on purpose,
    so batching cannot perturb the comparison."""
    out = []
    for i, (ctx, cont) in enumerate(pairs):
        try:
            g = client.greedy(base_url, ctx, scoring.GREEDY_TOKENS, timeout)
            tf = client.teacher_forced(base_url, ctx, cont, timeout=timeout)
            out.append({"prompt_tokens": len(ctx), "output_ids": g["output_ids"], "greedy_latency_s": g["latency_s"],
                        "top": tf["top"], "kept_mass": g["kept_mass"], "kept_mass_tf": tf["kept_mass"],
                        "error": None})
        except (client.RequestError, ValueError) as e:
            out.append({"prompt_tokens": len(ctx), "error": str(e)})
    log(f"[fidelity] {len(pairs)} probes done, {sum(1 for o in out if o['error'])} errors")
    return out


def tokenize_pairs(tokenizer, pairs: list[tuple[str, str]]) -> list[tuple[list[int], list[int]]]:
    """Tokenise (context, continuation) text pairs without special tokens, the
    continuation separately so both runs see the same token boundary."""
    out = []
    for ctx, cont in pairs:
        c = tokenizer.encode(ctx, add_special_tokens=False)
        k = tokenizer.encode("\n\n" + cont, add_special_tokens=False)
        out.append((c, k))
    return out


def warmup(base_url: str, model: str, timeout: float = 300.0) -> None:
    """One short chat so first-request costs (JIT, graph capture) stay out of the timings."""
    client._post(base_url + "/v1/chat/completions", {"model": model, "temperature": 0.0, "max_tokens": 4,
                 "messages": [{"role": "user", "content": "Say OK."}]}, timeout)


# Modes whose documents go through the ``documents`` field of the API (scored against the stock inline prompt).
DOCUMENTS_API_MODES = ("samkv",)


def run_mode(base_url: str, preset: Preset, tasks: list[Task], pairs, model: str, log=print,
             concurrency: int = 1, mode: str = "off", time_budget_s: float | None = None) -> dict:
    """The whole suite for one mode: warm-up, tasks, fidelity probes, wall times."""
    rec: dict = {}
    t = time.monotonic()
    warmup(base_url, model)
    rec["tasks"] = run_tasks(base_url, tasks, model, preset.max_tokens, log, concurrency=concurrency,
                             documents_api=mode in DOCUMENTS_API_MODES, time_budget_s=time_budget_s)
    rec["concurrency"] = concurrency
    rec["tasks_wall_s"] = time.monotonic() - t
    t = time.monotonic()
    rec["fidelity"] = run_fidelity(base_url, pairs, log)
    rec["fidelity_wall_s"] = time.monotonic() - t
    return rec
