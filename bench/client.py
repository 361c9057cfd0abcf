"""HTTP client side of the harness: multi-turn chats through the OpenAI API and
teacher-forced / greedy probes through SGLang's native ``/generate``.

Multi-turn tasks are sent as real conversations: turn j's request carries the system
prompt, all earlier user turns and the server's own earlier replies, so the radix cache
serves the shared prefix (``cached_tokens`` is recorded per turn). The assistant turn is
opened with the task's generic ``answer_prefix`` (``continue_final_message``); the
reply recorded and scored is the generated continuation only.

Attention mass kept: a sparse mode reports it per request as
``meta_info["sparse"]["kept_mass"]`` (a float in [0, 1], the fraction of softmax mass
the mode's selection retained, averaged over its heads/layers/steps). On
``/v1/chat/completions`` it arrives in ``choices[0].meta_info`` when the request sets
``return_meta_info``. Absent means "not reported" (dense reports nothing).
"""

from __future__ import annotations

import time

import requests

from bench.tasks import Task
from sglang_sparse.api_hooks import request_summary

KEPT_MASS_KEYS = ("sparse", "kept_mass")
TOP_K = 20


class RequestError(RuntimeError):
    pass


def kept_mass(meta_info: dict | None) -> float | None:
    """The mode-reported kept attention mass from a ``meta_info`` dict, or None.

    Chat responses carry the per-request summary (``meta_info["sparse"]["kept_mass"]``); the native
    ``/generate`` carries the mode's per-token step rows (e.g. ``meta_info["sparse_psa_steps"]``), summarised here.
    """
    cur = meta_info or {}
    if "sparse" not in cur:
        summary = request_summary(cur)
        return None if summary is None else summary.get("kept_mass")
    for k in KEPT_MASS_KEYS:
        if not isinstance(cur, dict) or k not in cur:
            return None
        cur = cur[k]
    try:
        return float(cur)
    except (TypeError, ValueError):
        return None


def _post(url: str, payload: dict, timeout: float) -> dict:
    try:
        r = requests.post(url, json=payload, timeout=timeout)
    except requests.RequestException as e:
        raise RequestError(f"POST {url} failed: {e}") from e
    if r.status_code != 200:
        raise RequestError(f"POST {url} -> HTTP {r.status_code}: {r.text[:500]}")
    return r.json()


def uses_documents_api(task: Task, documents_api: bool) -> bool:
    """Whether ``task`` goes through the ``documents`` field (a documents-API run and a task that
    carries its documents apart, :mod:`bench.tasks_long` ``rag``); else its stock inline prompt."""
    return documents_api and bool(task.meta.get("documents")) and len(task.turns) == 1


def run_conversation(base_url: str, task: Task, model: str, max_tokens: int,
                     timeout: float = 600.0, documents_api: bool = False) -> list[dict]:
    """Play a task turn by turn (greedy) and return one record per turn.

    ``documents_api``: tasks with documents send them in ``extra_body.documents`` (``--sparse samkv``)
    and only the question as the user message; every other task is sent as a stock client would.
    The per-request report of a sparse mode (``meta_info.sparse``) is kept as ``sparse``."""
    messages = [{"role": "system", "content": task.system}]
    out = []
    docs = uses_documents_api(task, documents_api)
    for j, turn in enumerate(task.turns):
        messages.append({"role": "user", "content": task.meta["question"] if docs else turn.user})
        payload = {"model": model, "messages": messages, "temperature": 0.0, "max_tokens": max_tokens,
                   "return_meta_info": True, "return_token_ids": True}
        if docs:
            payload["documents"] = list(task.meta["documents"])
        if task.answer_prefix:
            payload["messages"] = messages + [{"role": "assistant", "content": task.answer_prefix}]
            payload["continue_final_message"] = True
        t0 = time.perf_counter()
        resp = _post(base_url + "/v1/chat/completions", payload, timeout)
        latency = time.perf_counter() - t0
        choice = resp["choices"][0]
        reply = choice["message"]["content"] or ""
        meta = choice.get("meta_info") or {}
        usage = resp.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        out.append({
            "turn": j, "reply": reply, "token_ids": choice.get("token_ids") or [],
            "latency_s": latency, "prompt_tokens": usage.get("prompt_tokens"),
            "completion_tokens": usage.get("completion_tokens"),
            "cached_tokens": meta.get("cached_tokens", details.get("cached_tokens")),
            "kept_mass": kept_mass(meta), "documents_api": docs,
            "sparse": meta.get("sparse") or (resp.get("metadata") or {}).get("sparse"),
        })
        messages.append({"role": "assistant", "content": (task.answer_prefix or "") + reply})
    return out


def greedy(base_url: str, input_ids: list[int], max_new_tokens: int, timeout: float = 600.0) -> dict:
    """Greedy continuation of raw token ids: output ids, latency, kept mass."""
    t0 = time.perf_counter()
    d = _post(base_url + "/generate", {"input_ids": input_ids, "sampling_params":
              {"temperature": 0.0, "max_new_tokens": max_new_tokens}}, timeout)
    return {"output_ids": d.get("output_ids") or [], "latency_s": time.perf_counter() - t0,
            "kept_mass": kept_mass(d.get("meta_info"))}


def teacher_forced(base_url: str, context_ids: list[int], continuation_ids: list[int],
                   top_k: int = TOP_K, timeout: float = 600.0) -> dict:
    """Top-k next-token logprobs at every continuation position, teacher-forced.

    Returns ``top`` aligned with ``continuation_ids``: entry i is the distribution that
    predicts continuation token i (from the prompt pass, i.e. prefill).
    """
    if not context_ids or not continuation_ids:
        raise ValueError("teacher_forced needs a non-empty context and continuation")
    ids = list(context_ids) + list(continuation_ids)
    start = len(context_ids) - 1  # entry 0 = the last context token (no logprob); entry i+1 predicts cont[i]
    d = _post(base_url + "/generate", {"input_ids": ids, "sampling_params": {"temperature": 0.0,
              "max_new_tokens": 1}, "return_logprob": True, "logprob_start_len": start,
              "top_logprobs_num": top_k}, timeout)
    meta = d.get("meta_info") or {}
    top = meta.get("input_top_logprobs")
    if not isinstance(top, list):
        raise RequestError(f"/generate returned no input_top_logprobs list (got {type(top).__name__})")
    # the prompt pass yields predictions for ids[start+1:]; the generated token's is separate
    top = top[1:1 + len(continuation_ids)]
    return {"top": top, "kept_mass": kept_mass(meta)}
