"""Faults injected on purpose against real local servers, CPU or GPU.

    python -m bench.faults --out faults.json                       # every fault, every mode it applies to
    python -m bench.faults --faults knobs_at_limits,abort_decode --modes psa --out f.json

Each fault (:data:`FAULTS`) runs against a server started for it (one per (mode, config), shared, stopped by its
process group). It must end in a clear error (4xx naming the problem, exit 2 with one line at start-up) or a
documented fallback, never in a crash (the server is alive and answers afterwards), a hang (per-request timeout),
a leaked slot (SGLang's idle memory check silent in the log; ``/flush_cache`` and a request afterwards work) or a
wrong answer (a planted-fact probe after the fault answered as on the same server before it; under ``samkv`` a
documents probe too, or a dense ``fallback`` reply holding the planted fact).

Report (``--out``): per fault its mode, what was done, outcome (error|fallback|served), survived, checks and
details; ``faults_tried``, ``faults_survived`` (docs/soak.md). Only 127.0.0.1 servers are started and queried.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import re
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from bench.corpus import haystack
from bench.server import free_port
from bench.soak import _fact, _plant
from bench.soak_observe import leak_check, scrape, wait_idle

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = REPO / "models" / "SmolLM2-135M-Instruct"
MODES = ("psa", "loopserve", "samkv", "lastwindow", "off")
# server key -> (mode, --sparse-config, --max-total-tokens): one server per key, shared by the faults
SERVERS = {
    "psa": ("psa", {"min_context": 256}, 4000),
    "loopserve": ("loopserve", {"min_context": 256, "line_store_mb": 1}, 4000),
    # min_document_tokens / min_middle_blocks 0: the faults' short documents go through the reuse and assembly, not
    # the dense recompute
    "samkv": ("samkv", {"max_documents": 8, "max_document_chars": 8000, "min_document_tokens": 0,
                        "min_middle_blocks": 0}, 4000),
    "off": ("off", None, 4000),
    # a host tier of 0.02 GiB holds ~900 tokens of SmolLM2-135M KV (30 layers x 3 KV heads x 64 x 2 x 2 B)
    "psa_tier": ("psa", {"min_context": 256, "host_tier_gb": 0.02, "gpu_cache_mb": 8}, 1600),
}
LEAK = re.compile(r"leak|traceback", re.IGNORECASE)


class Hang(Exception):  # a request ran past the per-request timeout
    pass


# --------------------------------------------------------------------------- servers
class Handle:
    """One launched server, its log, and the reference replies of its probes (taken before any fault)."""

    def __init__(self, server, log_path: Path, timeout_s: float):
        self.server, self.log_path, self.timeout_s = server, log_path, timeout_s
        self.mode, self.url, self.ref = server.spec.mode, server.url, {}

    def chat(self, messages, max_tokens: int = 8, **extra) -> tuple[int, dict | str]:
        """A greedy chat request: (HTTP status, JSON body or text); :class:`Hang` past the timeout."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        payload = {"model": "default", "messages": messages, "temperature": 0, "max_tokens": max_tokens, **extra}
        try:
            r = requests.post(self.url + "/v1/chat/completions", json=payload, timeout=self.timeout_s)
        except requests.Timeout as e:
            raise Hang(f"no answer in {self.timeout_s:.0f}s") from e
        try:
            return r.status_code, r.json()
        except ValueError:
            return r.status_code, r.text

    def log_size(self) -> int:
        return self.log_path.stat().st_size if self.log_path.exists() else 0


def reply(body) -> str:
    return (body["choices"][0]["message"]["content"] or "") if isinstance(body, dict) else ""


def sparse_meta(body) -> dict:
    return ((body.get("metadata") or {}).get("sparse") or {}) if isinstance(body, dict) else {}


class Ctx:
    """The run: model, device, launched servers (by key), logs, timeouts."""

    def __init__(self, model: str, log_dir: Path, timeout_s: float, log=print, extra_args: list[str] | None = None):
        """``extra_args``: appended to every launched server's arguments (e.g. ``--mem-fraction-static 0.95`` on
        a GPU shared with other servers)."""
        self.model, self.log_dir, self.timeout_s, self.log = model, Path(log_dir), timeout_s, log
        self.extra_args = list(extra_args or [])
        import torch

        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.handles: dict[str, Handle] = {}
        self.pids: list[int] = []  # every server launched (stopped by its process group)

    def launch(self, key: str, mode: str, cfg: dict | None, max_total: int) -> Handle:
        from bench.server import Server, ServerSpec

        extra = ["--max-total-tokens", str(max_total)]
        extra += ["--attention-backend", "flashinfer"] if self.device == "cuda" else []
        extra += self.extra_args
        spec = ServerSpec(python=sys.executable, model=self.model, device=self.device, port=free_port(), mode=mode,
                          sparse_config=json.dumps(cfg) if cfg else None, extra_args=["--enable-metrics", *extra])
        log_path = self.log_dir / f"faults_server_{key}.log"
        server = Server(spec, log_path, timeout_s=600, log=self.log)
        try:
            server.start()
        finally:
            if server.pid:
                self.pids.append(server.pid)
        return Handle(server, log_path, self.timeout_s)

    def server(self, key: str) -> Handle:
        if key not in self.handles:
            mode, cfg, max_total = SERVERS[key]
            h = self.handles[key] = self.launch(key, mode, cfg, max_total)
            h.ref = probes(h)  # the replies before any fault
        return self.handles[key]

    def stop_all(self) -> None:
        for h in self.handles.values():
            h.server.stop()
        self.handles.clear()


# --------------------------------------------------------------------------- traffic
def fact_prompt(seed: str, words: int) -> tuple[list[dict], str]:
    """Messages asking for a fact planted in ``words`` words of prose (the reply continues the answer's prefix)."""
    rng = random.Random(seed)
    statement, question, answer, prefix = _fact(rng)
    text = _plant(rng, statement, words)
    return ([{"role": "user", "content": f"Read this note.\n\n{text}\n\n{question}"},
             {"role": "assistant", "content": prefix}], answer)


def documents(seed: str, words: int, n: int = 2) -> tuple[list[str], str, str]:
    """``n`` documents, the first with a planted fact: (documents, question, answer)."""
    rng = random.Random(seed)
    statement, question, answer, _ = _fact(rng)
    docs = [_plant(rng, statement, words)] + ["\n\n".join(haystack(words, rng)) for _ in range(n - 1)]
    return docs, question, answer


def ask_fact(h: Handle, seed: str, words: int, **extra) -> tuple[int, str, dict]:
    msgs, _ = fact_prompt(seed, words)
    st, body = h.chat(msgs, continue_final_message=True, **extra)
    return st, reply(body) if st == 200 else str(body)[:300], sparse_meta(body)


def ask_docs(h: Handle, seed: str, words: int, n: int = 2, **extra) -> tuple[int, str, dict]:
    docs, question, _ = documents(seed, words, n)
    prefix = question.replace("What is", "The").rstrip("?") + " is"  # the reply continues the answer's prefix
    st, body = h.chat([{"role": "user", "content": "Use the documents to answer. " + question},
                       {"role": "assistant", "content": prefix}], documents=docs, continue_final_message=True,
                      **extra)
    return st, reply(body) if st == 200 else str(body)[:300], sparse_meta(body)


def probes(h: Handle) -> dict[str, str]:
    """The planted-fact probe replies (plain; under samkv also a documents probe)."""
    out = {"plain": ask_fact(h, "probe", 250)[1]}
    if h.mode == "samkv":
        out["documents"] = ask_docs(h, "probe-docs", 200)[1]
    return out


def flush(h: Handle) -> bool:
    with contextlib.suppress(requests.Timeout):
        return requests.post(h.url + "/flush_cache", params={"timeout": 60}, timeout=h.timeout_s).status_code == 200
    return False


def concurrently(fns, workers: int = 4) -> list:
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda f: f(), fns))


# --------------------------------------------------------------------------- the checks after a fault
def after_checks(h: Handle, offset: int) -> dict:
    """Crash, hang, leak and wrong-answer checks after a fault on ``h`` (log read from byte ``offset``)."""
    c: dict = {"alive": h.server.proc is not None and h.server.proc.poll() is None}
    try:
        st, body = h.chat("Say hello.", max_tokens=4)
        c["plain_chat"] = st == 200
        time.sleep(1)  # idle: SGLang's scheduler runs its memory check as soon as it is idle (a leak is logged and aborts it)
        c["flush_cache"] = flush(h)
        st, body = h.chat("Say hello again.", max_tokens=4)
        c["after_flush_chat"] = st == 200
        plain = ask_fact(h, "probe", 250)[1]
        c["probe_same_as_before"] = plain == h.ref["plain"]
        if not c["probe_same_as_before"]:
            c["probe"] = {"before": h.ref["plain"], "after": plain}
        if "documents" in h.ref:
            c["documents_probe"] = docs_probe_ok(h)
        c["hang"] = False
    except (Hang, requests.RequestException) as e:
        c["hang"] = isinstance(e, Hang)
        c["error"] = f"{type(e).__name__}: {e}"[:300]
    c["alive"] = c["alive"] and h.server.proc is not None and h.server.proc.poll() is None
    c["idle_leak_check"] = leak_check(str(h.log_path), offset)
    text = h.log_path.read_bytes()[offset:].decode(errors="replace") if h.log_path.exists() else ""
    c["log_lines_flagged"] = [ln[:200] for ln in text.splitlines() if LEAK.search(ln)][:5]
    return c


def docs_probe_ok(h: Handle) -> dict:
    """The documents probe after a fault: the same reply as before, or a dense fallback holding the fact."""
    _, _, answer = documents("probe-docs", 200)
    seen = []
    for _ in range(2):  # after a fallback the front door forgets the documents; the next request re-prefills them
        st, text, meta = ask_docs(h, "probe-docs", 200)
        status = meta.get("scheduler_status")
        seen.append({"http": st, "status": status, "reply": text[:80]})
        if st == 200 and (text == h.ref["documents"] or (status == "fallback" and answer in text)):
            return {"ok": True, "seen": seen}
    return {"ok": False, "before": h.ref["documents"], "seen": seen}


def survived(c: dict, fault_ok: bool) -> bool:
    docs_ok = c.get("documents_probe", {"ok": True})["ok"]
    return bool(fault_ok and c.get("alive") and c.get("plain_chat") and c.get("flush_cache")
                and c.get("after_flush_chat") and c.get("probe_same_as_before") and docs_ok and not c.get("hang")
                and c.get("idle_leak_check") == "silent" and not c.get("log_lines_flagged"))


def result(fault: str, mode: str, did: str, outcome: str, ok: bool, checks: dict, **details) -> dict:
    return {"fault": fault, "mode": mode, "did": did, "outcome": outcome, "survived": survived(checks, ok),
            "fault_ok": ok, "checks": checks, "details": details}


# --------------------------------------------------------------------------- faults
def kv_pressure(ctx: Ctx, mode: str) -> dict:
    """A KV pool of 4000 tokens, 6 concurrent requests of ~550 tokens, twice (radix nodes evicted, with their
    line sets / PSA block metadata / document entries), then the first ones again."""
    h = ctx.server(mode)
    off = h.log_size()
    one = (lambda i: ask_docs(h, f"kv-docs-{i}", 200, cache_salt=f"t{i % 2}", max_tokens=5)) if mode == "samkv" \
        else (lambda i: ask_fact(h, f"kv-{i}", 400, max_tokens=5))
    did = ("6 concurrent documents requests (2 x 200-word documents each, 2 salts)" if mode == "samkv" else
           "6 concurrent ~550-token planted-fact chats") + ", twice with new prompts, then the first 2 again"
    res = concurrently([lambda i=i: one(i) for i in range(6)])
    res += concurrently([lambda i=i: one(100 + i) for i in range(6)])
    res += concurrently([lambda i=i: one(i) for i in range(2)])
    statuses = [m.get("scheduler_status") for _, _, m in res]
    ok = all(st == 200 for st, _, _ in res)
    fallback = mode == "samkv" and "fallback" in statuses
    repeat_same = [res[i][1] == res[12 + i][1] or (mode == "samkv") for i in range(2)]
    c = after_checks(h, off)
    return result("kv_pressure", mode, did, "fallback" if fallback else "served", ok and all(repeat_same), c,
                  http=[st for st, _, _ in res], scheduler_status=statuses if mode == "samkv" else None,
                  repeated_replies_equal=repeat_same, replies=[t[:40] for _, t, _ in res[:3]])


def doc_evicted(ctx: Ctx, mode: str) -> dict:
    """samkv: documents cached, then evicted (/flush_cache; then KV pressure from plain prompts) before the
    request that uses them: a dense fallback (or a re-prefill), with the planted fact answered."""
    h = ctx.server("samkv")
    off = h.log_size()
    docs, _, answer = documents("evict-docs", 200)
    first = ask_docs(h, "evict-docs", 200)
    flush(h)
    after_flush = ask_docs(h, "evict-docs", 200)
    again = ask_docs(h, "evict-docs", 200)  # re-prefilled and cached
    for i in range(3):  # ~1100-token prompts into a 4000-token pool: the documents' nodes are evicted
        h.chat(fact_prompt(f"evict-fill-{i}", 800)[0], continue_final_message=True, max_tokens=4)
    after_pressure = ask_docs(h, "evict-docs", 200)
    steps = {"cached": first, "after_flush": after_flush, "re_prefilled": again, "after_pressure": after_pressure}
    ok = all(st == 200 for st, _, _ in steps.values())
    for name in ("after_flush", "after_pressure"):
        st, text, meta = steps[name]
        ok = ok and (text == first[1] or (meta.get("scheduler_status") == "fallback" and answer in text))
    fallback = any(m.get("scheduler_status") == "fallback" or m.get("documents_prefilled")
                   for name, (_, _, m) in steps.items() if name.startswith("after"))
    c = after_checks(h, off)
    return result("doc_evicted", mode, "documents cached, evicted by /flush_cache and by KV pressure, asked again",
                  "fallback" if fallback else "served", ok, c, answer=answer,
                  steps={k: {"http": st, "reply": t[:60], "scheduler_status": m.get("scheduler_status"),
                             "documents_prefilled": m.get("documents_prefilled")} for k, (st, t, m) in steps.items()})


def _loopserve_stats(h: Handle) -> dict:
    info = requests.get(h.url + "/server_info", timeout=30).json()["internal_states"][0]["sparse"]
    return info.get("stats") or {}


def line_store_full(ctx: Ctx, mode: str) -> dict:
    """loopserve with line_store_mb 1: 3 chats x 3 turns of ~350-word turns; the store stays within its budget
    (older turns' lines are evicted or a turn is stored without lines: documented), replies stay right."""
    h = ctx.server("loopserve")
    off = h.log_size()
    s0 = _loopserve_stats(h)
    http = []
    for chat in range(3):
        msgs = []
        for turn in range(3):
            m, _ = fact_prompt(f"lines-{chat}-{turn}", 350)
            msgs.append(m[0])
            st, body = h.chat(msgs, max_tokens=6)
            http.append(st)
            msgs.append({"role": "assistant", "content": reply(body) if st == 200 else "ok"})
    s1 = _loopserve_stats(h)
    budget = 1 << 20
    stored = s1.get("stored_turns", 0) - s0.get("stored_turns", 0)
    prefills = s1.get("sparse_prefills", 0) - s0.get("sparse_prefills", 0)
    ok = all(st == 200 for st in http) and "line_store_bytes" in s1 and s1["line_store_bytes"] <= budget
    full = stored < prefills or s1.get("line_store_bytes", 0) > budget // 2
    c = after_checks(h, off)
    return result("line_store_full", mode, "9 multi-turn chat requests against a 1 MiB line store",
                  "fallback" if full else "served", ok, c, http=http, sparse_prefills=prefills, stored_turns=stored,
                  line_store_bytes=s1.get("line_store_bytes"), budget_bytes=budget,
                  reused_lines=s1.get("reused_lines", 0) - s0.get("reused_lines", 0))


def host_tier_full(ctx: Ctx, mode: str) -> dict:
    """psa + a 0.02 GiB host tier (~900 tokens) under a 1600-token KV pool: 5 prompts of ~650 tokens evict each
    other into a tier that holds about one, so it drops entries (LRU); the last one saved (a host load) and one
    dropped (recomputed) come back with the same replies."""
    h = ctx.server("psa_tier")
    off = h.log_size()
    first = [ask_fact(h, f"tier-{i}", 480, max_tokens=5) for i in range(5)]
    again = [ask_fact(h, f"tier-{i}", 480, max_tokens=5) for i in (2, 0)]
    ht = requests.get(h.url + "/server_info", timeout=30).json()["internal_states"][0]["sparse"].get("host_tier", {})
    ok = all(st == 200 for st, _, _ in first + again) and again[0][1] == first[2][1] and again[1][1] == first[0][1]
    ok = ok and not ht.get("failed_loads") and 0 < ht.get("host_bytes_total", 0) \
        and ht.get("host_bytes", 0) <= ht["host_bytes_total"]
    full = bool(ht.get("dropped_nodes") or ht.get("unsaved_nodes"))
    c = after_checks(h, off)
    keys = ("saved_tokens", "loaded_tokens", "host_nodes", "host_bytes", "host_bytes_total", "dropped_nodes",
            "unsaved_nodes", "failed_loads")
    return result("host_tier_full", "psa", "5 x ~650-token prompts through a 1600-token pool into a ~900-token "
                  "host tier, then 2 of them again", "fallback" if full else "served", ok, c,
                  host_tier={k: ht.get(k) for k in keys},
                  replies_equal=[again[0][1] == first[2][1], again[1][1] == first[0][1]])


def _send_and_close(h: Handle, payload: dict, seconds: float) -> str:
    """POST ``payload`` on a raw socket and close the connection ``seconds`` later, whatever came back."""
    body = json.dumps(payload).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", h.server.spec.port), timeout=10) as s:
        s.sendall(head + body)
        time.sleep(seconds)
        s.setblocking(False)
        got = b""
        with contextlib.suppress(BlockingIOError):
            got = s.recv(1 << 16)
    return f"closed after {seconds}s ({'stream' if payload.get('stream') else 'non-stream'}, " \
           f"{len(got)} bytes received)"


def _close_after_chunks(h: Handle, payload: dict, chunks: int) -> str:
    with requests.post(h.url + "/v1/chat/completions", json=payload, stream=True, timeout=h.timeout_s) as r:
        n = 0
        for line in r.iter_lines():
            if line.startswith(b"data: "):
                n += 1
                if line == b"data: [DONE]":
                    return f"finished before the abort ({n} chunks)"
                if n >= chunks:
                    break
    return f"closed after {n} chunks"


def _abort(fault: str, what: str, h: Handle, payload: dict, seconds: float | None = None,
           chunks: int | None = None) -> dict:
    """The abort twice (streamed, then not, for a timed abort), the server idle again, then the checks."""
    off = h.log_size()
    m0 = scrape(h.url)
    outcomes = [_send_and_close(h, {**payload, "stream": stream}, seconds) if seconds is not None
                else _close_after_chunks(h, {**payload, "stream": True}, chunks) for stream in (True, False)]
    m1 = wait_idle(h.url, 60)
    idle = m1 is None or (m1["sglang:num_running_reqs"] == 0 and m1["sglang:num_queue_reqs"] == 0)
    aborted = None if m0 is None or m1 is None else \
        m1["sglang:num_aborted_requests_total"] - m0["sglang:num_aborted_requests_total"]
    c = after_checks(h, off)
    return result(fault, h.mode, what, "served", idle, c, client_side=outcomes, idle_after=idle,
                  server_aborted_requests=aborted)


def abort_prefill(ctx: Ctx, mode: str) -> dict:
    h = ctx.server(mode)
    msgs, _ = fact_prompt("abort-prefill", 2000)
    return _abort("abort_prefill", "~2700-token prompt, connection closed 0.2 s after sending (streamed, then not)",
                  h, {"model": "default", "messages": msgs, "max_tokens": 16, "continue_final_message": True},
                  seconds=0.2)


def abort_assembly(ctx: Ctx, mode: str) -> dict:
    h = ctx.server("samkv")
    docs, q, _ = documents("abort-docs", 300, n=3)
    return _abort("abort_assembly", "documents request (3 new documents), connection closed 0.3 s after sending "
                  "(streamed: while its documents are prefilled; then not streamed, the documents cached: during "
                  "assembly)", h, {"model": "default", "messages": [{"role": "user", "content": q}], "max_tokens": 16,
                                   "documents": docs}, seconds=0.3)


def abort_decode(ctx: Ctx, mode: str) -> dict:
    h = ctx.server(mode)
    msgs, _ = fact_prompt("abort-decode", 300)
    return _abort("abort_decode", "streamed 64-token reply, connection closed after 3 chunks (twice)", h,
                  {"model": "default", "messages": msgs[:1], "max_tokens": 64, "stream": True}, chunks=3)


# per mode: (valid custom_params.sparse at the limits, just beyond them) from request_params.REQUEST_OPTIONS
def _knob_cases(mode: str) -> tuple[list[dict], list[dict]]:
    from sglang_sparse.request_params import REQUEST_OPTIONS

    ok, bad = [], []
    for o in REQUEST_OPTIONS.get(mode, ()):
        lo = int(o.lo) + 1 if o.integer else 1e-9  # the ranges are (lo, hi]
        hi = int(o.hi) if o.integer else float(o.hi)
        ok += [{o.name: lo}, {o.name: hi}]
        bad += [{o.name: int(o.lo) if o.integer else float(o.lo)}, {o.name: hi + 1 if o.integer else hi + 1e-6}]
    return ok, bad


def knobs_at_limits(ctx: Ctx, mode: str) -> dict:
    """custom_params.sparse at the ends of its ranges (served, clamped to the server's floor / ceiling) and just
    beyond (400 naming the field); modes without per-request knobs refuse any (400); samkv also its request
    limits (max_documents, cache_salt length) at and beyond the limit."""
    h = ctx.server(mode)
    off = h.log_size()
    ok_cases, bad_cases = _knob_cases(mode)
    if not ok_cases:
        bad_cases = [{"epsilon": 0.9}]
    rows, fine = [], True
    for opts, want in [(o, 200) for o in ok_cases] + [(o, 400) for o in bad_cases]:
        st, body = h.chat("What is two plus two?", max_tokens=4, custom_params={"sparse": opts})
        named = want == 200 or any(k in str(body) for k in opts) or (not ok_cases and "custom_params" in str(body))
        rows.append({"custom_params.sparse": opts, "http": st, "expected": want,
                     "message": None if st == 200 else str(body)[:200]})
        fine = fine and st == want and named
    if mode == "samkv":
        limit = SERVERS["samkv"][1]["max_documents"]
        for n, salt, want in ((limit, "s" * 256, 200), (limit + 1, "s", 400), (2, "s" * 257, 400)):
            docs = [f"Note {i}: the sky was clear." for i in range(n)]
            st, body = h.chat("Which note is first?", max_tokens=4, documents=docs, cache_salt=salt)
            named = want == 200 or any(k in str(body) for k in ("documents", "cache_salt"))
            rows.append({"documents": n, "cache_salt_chars": len(salt), "http": st, "expected": want,
                         "message": None if st == 200 else str(body)[:200]})
            fine = fine and st == want and named
    c = after_checks(h, off)
    return result("knobs_at_limits", mode, f"{len(rows)} requests at and just beyond the per-request limits",
                  "error", fine, c, cases=rows)


# mode -> (a config at range edges that must start and answer, configs one step beyond an edge: exit 2)
EDGES = {
    "psa": ({"epsilon": 1.0, "min_context": 0, "micro_batch_blocks": 1, "max_blocks": 1, "sink_pages": 0,
             "local_pages": 0, "min_request_epsilon": 1.0, "dense_above": 1.0, "probe_steps": 1},
            [{"epsilon": 1.0000001}, {"micro_batch_blocks": 8192}, {"max_blocks": 0}, {"probe_steps": 0}]),
    "loopserve": ({"alpha": 1.0, "budget": 1, "n_d": 1, "min_context": 0, "sink_tokens": 0, "local_window": 1,
                   "sampled_rows": 1, "line_store_mb": 0},
                  [{"alpha": 1.01}, {"budget": 0}, {"line_store_mb": -1}]),
    "lastwindow": ({"budget": 1, "window": 1, "min_context": 0, "pool_kernel": 63, "sink_tokens": 0},
                   [{"pool_kernel": 65}, {"window": 0}]),
    "samkv": ({"block_size": 1, "initial_blocks": 0, "local_blocks": 0, "max_kept_ratio": 0.0,
               "recompute_ratio": 1.0, "mass_layer_from": 0.0, "mass_layer_to": 1.0, "max_documents": 1,
               "min_document_tokens": 0, "min_middle_blocks": 0},
              [{"block_size": 0}, {"max_kept_ratio": 1.5}, {"mass_layer_from": 1.0}, {"min_document_tokens": -1},
               {"min_middle_blocks": 65537}]),
}


# the launcher's argument check (sglang.launch_server's first step) on several configs: exit code, stderr of each
_PREPARE = """import contextlib, io, json, sys
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.server_args import prepare_server_args
out = []
for argv in json.loads(sys.argv[1]):
    err, code = io.StringIO(), 0
    try:
        with contextlib.redirect_stderr(err):
            prepare_server_args(argv)
    except SystemExit as e:
        code = e.code
    out.append([code, err.getvalue()])
print(json.dumps(out))"""


def _refused(ctx: Ctx, mode: str, configs: list[dict]) -> list[dict]:
    """Configs one step beyond an edge: the real entry point on the first, the launcher's argument check on the
    others (one process): exit 2 and one error line naming the field, before any model load."""
    argv = [["--model-path", ctx.model, "--device", ctx.device, "--port", str(free_port()), "--sparse", mode,
             "--sparse-config", json.dumps(cfg)] for cfg in configs]
    cmds = [[sys.executable, "-m", "sglang.launch_server", *argv[0]],
            [sys.executable, "-c", _PREPARE, json.dumps(argv[1:])]]
    with ThreadPoolExecutor(2) as pool:
        procs = list(pool.map(lambda c: subprocess.run(c, capture_output=True, text=True, timeout=300), cmds))
    got = [(procs[0].returncode, procs[0].stderr)] + [tuple(x) for x in json.loads(procs[1].stdout or "[]")]
    out = []
    for cfg, (code, err) in zip(configs, got):
        lines = [ln for ln in err.splitlines() if ln.strip() and "warn" not in ln.lower()
                 and not ln.startswith("  Example:")]
        named = bool(lines) and all(k in lines[-1] for k in cfg)
        out.append({"config": cfg, "via": "launch_server" if not out else "prepare_server_args", "exit": code,
                    "stderr_lines": lines[-3:], "ok": code == 2 and len(lines) == 1 and named})
    return out + [{"config": cfg, "ok": False, "error": "no result"} for cfg in configs[len(got):]]


def config_range_edges(ctx: Ctx, mode: str) -> dict:
    """The mode started at a range edge of several knobs answers (a documents request under samkv); one step
    beyond an edge the launcher exits 2 with one line naming the field."""
    good, beyond = EDGES[mode]
    refused = _refused(ctx, mode, beyond)
    h = ctx.launch(f"{mode}_edges", mode, good, 4000)
    try:
        off = 0
        h.ref = {"plain": ask_fact(h, "probe", 250)[1]}
        served = [ask_fact(h, "edge", 300)]
        if mode == "samkv":
            served.append(ask_docs(h, "edge-docs", 150, n=1))
        ok = all(st == 200 for st, _, _ in served) and all(r["ok"] for r in refused)
        c = after_checks(h, off)
    finally:
        h.server.stop()
    return result("config_range_edges", mode, f"started with {json.dumps(good)}; {len(beyond)} configs beyond an "
                  "edge", "error", ok, c, served=[{"http": st, "reply": t[:60],
                                                   "sparse": {k: m.get(k) for k in ("mode", "scheduler_status")}}
                                                  for st, t, m in served], refused=refused)


# fault name -> (function, modes it applies to). Order = run order (cheap, shared servers first).
FAULTS = {
    "knobs_at_limits": (knobs_at_limits, ("psa", "loopserve", "samkv", "off")),
    "abort_decode": (abort_decode, ("psa", "loopserve", "samkv", "off")),
    "abort_prefill": (abort_prefill, ("psa", "loopserve", "samkv", "off")),
    "abort_assembly": (abort_assembly, ("samkv",)),
    "kv_pressure": (kv_pressure, ("psa", "loopserve", "samkv")),
    "doc_evicted": (doc_evicted, ("samkv",)),
    "line_store_full": (line_store_full, ("loopserve",)),
    "host_tier_full": (host_tier_full, ("psa",)),
    "config_range_edges": (config_range_edges, ("psa", "loopserve", "lastwindow", "samkv")),
}


def run(ctx: Ctx, faults: list[str], modes: list[str]) -> dict:
    """Every (fault, mode) pair, grouped by mode (its servers stopped after its last fault)."""
    out = []
    for mode in modes:
        for name in faults:
            fn, applies = FAULTS[name]
            if mode not in applies:
                continue
            t0 = time.monotonic()
            ctx.log(f"[faults] {name} / {mode}")
            try:
                rec = fn(ctx, mode)
            except Exception as e:  # a crash of the driver or a refused request; the fault did not pass
                rec = {"fault": name, "mode": mode, "did": (fn.__doc__ or "").split("\n")[0], "outcome": "error",
                       "survived": False, "checks": {}, "details": {"exception": f"{type(e).__name__}: {e}"[:500]}}
            rec["seconds"] = round(time.monotonic() - t0, 1)
            ctx.log(f"[faults] {name} / {mode}: {rec['outcome']}, survived={rec['survived']} in {rec['seconds']}s")
            out.append(rec)
        ctx.stop_all()
    return {"device": ctx.device, "model": ctx.model, "server_pids": ctx.pids, "faults": out, "faults_tried": len(out),
            "faults_survived": sum(r["survived"] for r in out)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.faults", description=__doc__.split("\n\n")[0])
    ap.add_argument("--faults", default="all", help=f"comma-separated, or all: {', '.join(FAULTS)}")
    ap.add_argument("--modes", default="all", help=f"comma-separated, or all: {', '.join(MODES)}")
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--request-timeout", type=float, default=120.0, help="seconds per request (a hang past it fails)")
    ap.add_argument("--log-dir", default=".", help="where the server logs go")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra argument for every launched server (repeat; e.g. --server-arg=--mem-fraction-static=0.95)")
    ap.add_argument("--out", help="report JSON path (default: stdout)")
    a = ap.parse_args(argv)
    faults = list(FAULTS) if a.faults == "all" else [f.strip() for f in a.faults.split(",") if f.strip()]
    modes = list(MODES) if a.modes == "all" else [m.strip() for m in a.modes.split(",") if m.strip()]
    if set(faults) - set(FAULTS):
        ap.error(f"--faults: unknown {sorted(set(faults) - set(FAULTS))}; known: {', '.join(FAULTS)}")
    if set(modes) - set(MODES):
        ap.error(f"--modes: unknown {sorted(set(modes) - set(MODES))}; known: {', '.join(MODES)}")
    ctx = Ctx(a.model, Path(a.log_dir), a.request_timeout, log=lambda m: print(m, file=sys.stderr, flush=True),
              extra_args=a.server_arg)
    try:
        report = run(ctx, faults, modes)
    finally:
        ctx.stop_all()
    text = json.dumps(report, indent=1)
    if a.out:
        Path(a.out).write_text(text + "\n")
    else:
        print(text)
    return 0 if report["faults_survived"] == report["faults_tried"] else 1


if __name__ == "__main__":
    sys.exit(main())
