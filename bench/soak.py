"""Soak driver: mixed traffic against one local server (or several launched one after another), with
planted-fact answers checked, HTTP errors counted, and the server's memory followed.

    python -m bench.soak --url http://127.0.0.1:30000 --server-pid PID --requests 400 --time-budget 600
    python -m bench.soak --launch off,psa,samkv --requests 200 --out soak.json   # starts, runs, stops each

Traffic (deterministic from ``--seed``; every HTTP request counts as one request):

* ``chat``: multi-turn chats: a fact planted in a long first turn, a filler turn, then the question;
* ``rag``: shared documents (the same text under every salt) and one private document per ``cache_salt``
  (``--salts``), the question about a fact in one of them; sent in ``documents`` (``/v1/chat/completions``)
  when the server runs ``--sparse samkv``, inline in the user turn otherwise;
* ``stream``: streamed chats, half of them aborted by the client after a few chunks;
* ``knob``: a fact question with per-request options (``custom_params.sparse``, psa / loopserve only);
* ``bad``: an invalid per-request option that must be answered with HTTP 400 (the server keeps serving).

Report (``--out``, JSON): requests sent / completed / aborted / failed, 4xx (expected ones apart) and 5xx,
facts checked and wrong, ``wrong_vs_off`` (wrong here but right in ``--reference-json``, an ``off`` run's
report, or the ``off`` run of the same ``--launch`` list), server RSS (the ``--server-pid`` process and its
descendants, ``/proc``) every ``--sample-every`` requests with the least-squares slope over the last half of
the run in MB per 1k requests, GPU memory of those processes (``nvidia-smi``; skipped without it),
``/metrics`` counters against the requests sent (skipped when the server has no ``--enable-metrics``) and
SGLang's idle memory check (``memory leak detected`` in the server log: ``silent`` / ``reported``).
Only 127.0.0.1 is accepted as the server host.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlparse

import requests

from bench.corpus import haystack
from bench.mode_settings import reported_config
from bench.soak_observe import last_half_slope, leak_check, metrics_report, sample, scrape, wait_idle
from bench.sparse_configs import parse_mode_configs

ALLOWED_HOSTS = ("127.0.0.1",)
KINDS = ("chat", "rag", "stream", "knob", "bad")
# item i has kind CYCLE[i % 20]: 7 chat, 6 rag, 4 stream, 2 knob, 1 bad, every kind within the first 5 items
CYCLE = ("rag", "chat", "stream", "knob", "bad", "chat", "rag", "stream", "chat", "rag",
         "chat", "rag", "stream", "knob", "chat", "rag", "chat", "stream", "rag", "chat")
ANIMALS = ("heron", "otter", "lynx", "badger", "falcon", "marten", "ibis", "newt", "yak", "wren")
COLOURS = ("blue", "red", "amber", "green", "grey", "violet", "white", "black")


@dataclass(frozen=True)
class SoakConfig:
    """One soak run's bounds and traffic shape (validated; every error names its field)."""

    url: str = "http://127.0.0.1:30000"
    requests: int = 200
    time_budget_s: float = 600.0
    concurrency: int = 4
    seed: int = 0
    turn_words: int = 300
    max_tokens: int = 12
    salts: int = 3
    sample_every: int = 10
    request_timeout_s: float = 300.0
    server_pid: int | None = None
    server_log: str | None = None

    def __post_init__(self):
        host = urlparse(self.url).hostname
        if urlparse(self.url).scheme != "http" or host not in ALLOWED_HOSTS:
            raise ValueError(f"url = {self.url!r}: the soak driver only talks to http://127.0.0.1:PORT "
                             f"(got host {host!r})")
        for name, lo in (("requests", 1), ("concurrency", 1), ("turn_words", 1), ("max_tokens", 1),
                         ("salts", 1), ("sample_every", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name} = {v!r} must be an integer >= {lo}")
        for name in ("time_budget_s", "request_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name} = {v!r} must be a number > 0")


# --------------------------------------------------------------------------- workload
def _fact(rng: random.Random) -> tuple[str, str, str, str]:
    """(statement, question, answer, answer prefix) of one planted fact; the reply continues the prefix."""
    name = f"{rng.choice(COLOURS)} {rng.choice(ANIMALS)}"
    code = str(rng.randint(1000, 9999))
    return (f"The access code of the {name} locker is {code}.",
            f"What is the access code of the {name} locker?", code, f"The access code of the {name} locker is")


class Workload:
    """The planned items of a run: item ``i`` depends only on (seed, i), never on the mode, so runs of
    different modes ask the same questions and their answers can be compared item by item."""

    def __init__(self, cfg: SoakConfig):
        self.cfg = cfg
        rng = random.Random(f"{cfg.seed}-docs")
        self.shared = [_doc(rng, cfg.turn_words) for _ in range(2)]
        self.private = {f"soak-salt-{k}": _doc(rng, cfg.turn_words) for k in range(cfg.salts)}

    def item(self, i: int) -> dict:
        rng = random.Random(f"{self.cfg.seed}-{i}")
        kind = CYCLE[i % len(CYCLE)]
        item = {"id": i, "kind": kind}
        if kind == "rag":
            salt = rng.choice(sorted(self.private))
            docs = [rng.choice(self.shared), self.private[salt]]
            rng.shuffle(docs)
            target = rng.choice(docs)
            item.update(salt=salt, documents=[d["text"] for d in docs], question=target["question"],
                        answer=target["answer"], prefix=target["prefix"])
        else:
            statement, question, answer, prefix = _fact(rng)
            words = self.cfg.turn_words if kind == "chat" else max(20, self.cfg.turn_words // 4)
            item.update(context=_plant(rng, statement, words), question=question, answer=answer, prefix=prefix,
                        abort_after=rng.randint(1, 4) if kind == "stream" and rng.random() < 0.5 else None,
                        knob=rng.random())
        return item


def _doc(rng: random.Random, words: int) -> dict:
    statement, question, answer, prefix = _fact(rng)
    return {"text": _plant(rng, statement, words), "question": question, "answer": answer, "prefix": prefix}


def _plant(rng: random.Random, statement: str, words: int) -> str:
    paras = haystack(words, rng)
    paras.insert(rng.randint(0, len(paras)), statement)
    return "\n\n".join(paras)


def knob_options(mode: str, u: float) -> dict | None:
    """Valid per-request options of ``mode`` (None for modes without any), spread over their range by ``u``."""
    if mode == "psa":
        return {"epsilon": round(0.5 + 0.5 * u, 3)}
    if mode == "loopserve":
        return {"alpha": round(0.5 + 0.5 * u, 3), "budget": int(1 + u * 2047)}
    return None


# --------------------------------------------------------------------------- requests
class Stats:
    """Counters shared by the worker threads."""

    def __init__(self):
        self.lock = threading.Lock()
        self.c = {k: 0 for k in ("sent", "completed", "aborted", "failed", "rejected_as_expected",
                                 "http_4xx", "http_5xx", "facts_checked", "wrong", "documents_requests_served",
                                 "documents_requests_fallback", "documents_requests_assembled")}
        self.kinds = {k: 0 for k in KINDS}
        self.facts: dict[str, bool] = {}
        self.errors: list[str] = []
        self.wrong_replies: list[dict] = []
        self.fallback_reasons: dict[str, int] = {}

    def add(self, **kw):
        with self.lock:
            for k, v in kw.items():
                self.c[k] += v

    def add_reason(self, reason: str):
        """A documents request served by samkv's dense fallback, by the reason its response gave."""
        with self.lock:
            if reason in self.fallback_reasons or len(self.fallback_reasons) < 16:
                self.fallback_reasons[reason] = self.fallback_reasons.get(reason, 0) + 1

    def add_kind(self, kind: str):
        with self.lock:
            self.kinds[kind] += 1

    def fail(self, what: str, status: int | None = None):
        with self.lock:
            self.c["failed"] += 1
            if status is not None:
                self.c["http_5xx" if status >= 500 else "http_4xx"] += 1
            if len(self.errors) < 20:
                self.errors.append(what[:300])


class OutOfBudget(Exception):
    """The run's request count or time budget is spent: the item stops where it is (not a failure)."""


class Driver:
    """Plays workload items against the server (one ``requests.Session`` per worker thread)."""

    def __init__(self, cfg: SoakConfig, mode: str, stats: Stats, t0: float):
        self.cfg, self.mode, self.stats, self.t0 = cfg, mode, stats, t0
        self.session = threading.local()

    def _post(self, path: str, payload: dict, stream: bool = False) -> requests.Response:
        s = getattr(self.session, "s", None)
        if s is None:
            s = self.session.s = requests.Session()
        with self.stats.lock:
            if self.stats.c["sent"] >= self.cfg.requests or time.monotonic() - self.t0 > self.cfg.time_budget_s:
                raise OutOfBudget()
            self.stats.c["sent"] += 1
        return s.post(self.cfg.url + path, json=payload, stream=stream, timeout=self.cfg.request_timeout_s)

    def _chat(self, messages: list[dict], **extra) -> str | None:
        """One non-streaming chat request; the reply, or None after counting a failure."""
        payload = {"model": "default", "messages": messages, "temperature": 0, "max_tokens": self.cfg.max_tokens,
                   **extra}
        try:
            r = self._post("/v1/chat/completions", payload)
        except requests.RequestException as e:
            self.stats.fail(f"chat: {type(e).__name__}: {e}")
            return None
        if r.status_code != 200:
            self.stats.fail(f"chat: HTTP {r.status_code}: {r.text}", r.status_code)
            return None
        try:
            body = r.json()
            reply = body["choices"][0]["message"]["content"] or ""
        except (ValueError, KeyError, IndexError, TypeError) as e:
            self.stats.fail(f"chat: bad response ({e}): {r.text}")
            return None
        report = (body.get("metadata") or {}).get("sparse") or {}
        served = "documents" in extra and report.get("mode") == "samkv"
        # a documents request samkv answered densely (its documents not reusable: e.g. evicted) is counted apart,
        # so a run whose documents were never assembled does not read as a samkv soak
        fallback = served and report.get("scheduler_status") == "fallback"
        # assembled: served from reused document KV (not the dense fallback, nor recompute for short documents)
        assembled = served and report.get("scheduler_status") == "assembled"
        self.stats.add(completed=1, documents_requests_served=int(served), documents_requests_fallback=int(fallback),
                       documents_requests_assembled=int(assembled))
        if fallback:
            self.stats.add_reason(str(report.get("scheduler_reason") or "unknown"))
        return reply

    @staticmethod
    def _asking(item: dict, messages: list[dict]) -> dict:
        """The question's request fields: the reply continues the answer's prefix (small models answer)."""
        return {"messages": messages + [{"role": "assistant", "content": item["prefix"]}],
                "continue_final_message": True}

    def _check(self, item: dict, reply: str | None) -> None:
        if reply is None:
            return
        ok = item["answer"] in reply
        with self.stats.lock:
            self.stats.c["facts_checked"] += 1
            self.stats.c["wrong"] += 0 if ok else 1
            self.stats.facts[str(item["id"])] = ok
            if not ok and len(self.stats.wrong_replies) < 10:
                self.stats.wrong_replies.append({"id": item["id"], "kind": item["kind"], "answer": item["answer"],
                                                 "reply": reply[:200]})

    def run(self, item: dict) -> None:
        self.stats.add_kind(item["kind"])
        try:
            getattr(self, "kind_" + item["kind"])(item)
        except OutOfBudget:
            pass
        except Exception as e:  # a driver bug must not pass for a server fault silently
            self.stats.errors.append(f"driver: {type(e).__name__}: {e}")
            raise

    def kind_chat(self, item: dict) -> None:
        msgs = [{"role": "system", "content": "You are a helpful assistant. Answer briefly."},
                {"role": "user", "content": "Read this note and remember it.\n\n" + item["context"]}]
        for follow_up in ("Thank you. In one sentence, what is the note about?", item["question"]):
            reply = self._chat(msgs)
            if reply is None:
                return
            msgs += [{"role": "assistant", "content": reply}, {"role": "user", "content": follow_up}]
        self._check(item, self._chat(**self._asking(item, msgs)))

    def kind_rag(self, item: dict) -> None:
        question = "Use the documents to answer. " + item["question"]
        if self.mode == "samkv":
            reply = self._chat(**self._asking(item, [{"role": "user", "content": question}]),
                               documents=item["documents"], cache_salt=item["salt"])
        else:
            inline = "\n\n".join(item["documents"]) + "\n\n" + question
            reply = self._chat(**self._asking(item, [{"role": "user", "content": inline}]), cache_salt=item["salt"])
        self._check(item, reply)

    def kind_knob(self, item: dict) -> None:
        opts = knob_options(self.mode, item["knob"])
        extra = {"custom_params": {"sparse": opts}} if opts else {}
        ask = self._asking(item, [{"role": "user", "content": item["context"] + "\n\n" + item["question"]}])
        self._check(item, self._chat(**ask, **extra))

    def kind_bad(self, item: dict) -> None:
        payload = {"model": "default", "messages": [{"role": "user", "content": item["question"]}],
                   "max_tokens": 4, "custom_params": {"sparse": {"epsilon": "high", "alpha": -1}}}
        try:
            r = self._post("/v1/chat/completions", payload)
        except requests.RequestException as e:
            return self.stats.fail(f"bad: {type(e).__name__}: {e}")
        if r.status_code == 400:
            return self.stats.add(rejected_as_expected=1, http_4xx=1)
        self.stats.fail(f"bad option answered HTTP {r.status_code}, expected 400: {r.text}", r.status_code)

    def kind_stream(self, item: dict) -> None:
        payload = {"model": "default", "temperature": 0, "max_tokens": self.cfg.max_tokens * 2, "stream": True,
                   **self._asking(item, [{"role": "user", "content": item["context"] + "\n\n" + item["question"]}])}
        try:
            with self._post("/v1/chat/completions", payload, stream=True) as r:
                if r.status_code != 200:
                    return self.stats.fail(f"stream: HTTP {r.status_code}: {r.text}", r.status_code)
                chunks, done, text = 0, False, []
                for line in r.iter_lines():
                    if not line.startswith(b"data: "):
                        continue
                    if line == b"data: [DONE]":
                        done = True
                        break
                    chunks += 1
                    event = json.loads(line[6:])
                    if "error" in event:
                        return self.stats.fail(f"stream: error event {event['error']}")
                    delta = (event.get("choices") or [{}])[0].get("delta") or {}
                    text.append(delta.get("content") or "")
                    if item["abort_after"] is not None and chunks >= item["abort_after"]:
                        r.close()  # the client goes away mid-stream
                        return self.stats.add(aborted=1)
        except (requests.RequestException, ValueError) as e:
            return self.stats.fail(f"stream: {type(e).__name__}: {e}")
        if not done:
            return self.stats.fail("stream: ended without [DONE]")
        self.stats.add(completed=1)
        self._check(item, "".join(text))



def server_mode(url: str) -> tuple[str, dict | None]:
    """The server's ``--sparse`` mode and the sparse config it reports (``bench.mode_settings.reported_config``)."""
    r = requests.get(url + "/server_info", timeout=30)
    r.raise_for_status()
    info = r.json()
    return str(info.get("sparse", "off")), reported_config(info)


# --------------------------------------------------------------------------- one run
def run_soak(cfg: SoakConfig, reference: dict | None = None, log=print) -> dict:
    """Drive one server for ``cfg.requests`` requests or ``cfg.time_budget_s`` seconds; the report."""
    mode, sparse_config = server_mode(cfg.url)
    stats, work = Stats(), Workload(cfg)
    log_offset = os.path.getsize(cfg.server_log) if cfg.server_log and os.path.exists(cfg.server_log) else 0
    t0 = time.monotonic()
    driver = Driver(cfg, mode, stats, t0)
    samples = [s for s in [sample(cfg.server_pid, 0, t0)] if s]
    before = scrape(cfg.url)
    next_sample, i = cfg.sample_every, 0
    with ThreadPoolExecutor(cfg.concurrency) as pool:
        pending = set()
        while True:
            over_time = time.monotonic() - t0 > cfg.time_budget_s
            with stats.lock:
                sent = stats.c["sent"]
            if sent >= next_sample:
                s = sample(cfg.server_pid, sent, t0)
                if s:
                    samples.append(s)
                next_sample = sent + cfg.sample_every
            for f in [f for f in pending if f.done()]:
                f.result()  # re-raise a driver bug here
            pending = {f for f in pending if not f.done()}
            if (sent >= cfg.requests or over_time) and not pending:
                break
            if sent + len(pending) < cfg.requests and not over_time and len(pending) < cfg.concurrency:
                pending.add(pool.submit(driver.run, work.item(i)))
                i += 1
                continue
            time.sleep(0.05)
    elapsed = time.monotonic() - t0
    after = wait_idle(cfg.url)
    final = sample(cfg.server_pid, stats.c["sent"], t0)
    if final:
        samples.append(final)
    c = dict(stats.c)
    report = {"mode": mode, "sparse_config": sparse_config, "url": cfg.url, "config": asdict(cfg), "items": i,
              "items_by_kind": stats.kinds,
              "elapsed_s": round(elapsed, 1), **c, "errors": stats.errors, "facts": stats.facts,
              "rss": {"samples": samples, "slope_mb_per_1k_requests": last_half_slope(samples)} if samples
              else {"skipped": "no --server-pid"},
              "metrics": metrics_report(before, after, c, mode),
              "idle_leak_check": leak_check(cfg.server_log, log_offset)}
    report["wrong_vs_off"] = wrong_vs(reference, stats.facts)
    report["wrong_replies"] = stats.wrong_replies
    report["documents_fallback_reasons"] = stats.fallback_reasons
    log(f"[soak] {mode}: sent {c['sent']} completed {c['completed']} aborted {c['aborted']} failed {c['failed']} "
        f"4xx {c['http_4xx']} 5xx {c['http_5xx']} wrong {c['wrong']}/{c['facts_checked']} in {elapsed:.0f}s")
    return report


def wrong_vs(reference: dict | None, facts: dict[str, bool]) -> int | None:
    """Items answered wrong here that the reference (``off``) run answered right; None without one."""
    if not reference or "facts" not in reference:
        return None
    ref = reference["facts"]
    return sum(1 for k, ok in facts.items() if not ok and ref.get(k) is True)


# --------------------------------------------------------------------------- launching
def launch_and_run(modes: list[str], cfg: SoakConfig, model: str, log_dir: Path, reference: dict | None,
                   extra_args: list[str], log=print, repeat_off: bool = False,
                   sparse_configs: dict[str, str] | None = None) -> dict:
    """Start a server per mode (``off`` first when listed, as the others' reference), soak it, stop it by
    its process group. ``repeat_off``: soak a fresh ``off`` server once more at the end, reported as
    ``off_repeat``: its ``wrong_vs_off`` is the noise floor, the facts that flip from right to wrong between two
    runs of the same dense server (batch composition differs from run to run under concurrency)."""
    from bench.server import Server, ServerError, ServerSpec, free_port

    try:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        device = "cpu"
    modes = sorted(modes, key=lambda m: m != "off")
    runs = [(m, m) for m in modes] + ([("off_repeat", "off")] if repeat_off else [])
    out = {"device": device, "modes": {}}
    for key, mode in runs:
        port = free_port()
        spec = ServerSpec(python=sys.executable, model=model, device=device, port=port, mode=mode,
                          extra_args=["--enable-metrics", *extra_args],
                          sparse_config=(sparse_configs or {}).get(mode))
        log_path = log_dir / f"soak_server_{key}.log"
        try:
            server = Server(spec, log_path, timeout_s=900, log=log).start()
        except ServerError as e:  # a mode that cannot start is reported, the others still run
            out["modes"][key] = {"mode": mode, "error": str(e)[-2000:]}
            continue
        try:
            run_cfg = SoakConfig(**{**asdict(cfg), "url": server.url, "server_pid": server.pid,
                                    "server_log": str(log_path)})
            rep = run_soak(run_cfg, reference=reference, log=log)
        finally:
            server.stop()
        out["modes"][key] = rep
        if key == "off" and reference is None:
            reference = rep
            rep["wrong_vs_off"] = 0
    return out


# (flag, SoakConfig field, type, help) of the run's bounds and traffic shape
_OPTIONS = (("--url", "url", str, "server to soak (http://127.0.0.1:PORT only)"),
            ("--requests", "requests", int, "most HTTP requests per server"),
            ("--time-budget", "time_budget_s", float, "most seconds of traffic per server"),
            ("--concurrency", "concurrency", int, "requests in flight"),
            ("--seed", "seed", int, "workload seed (the same items in every mode)"),
            ("--turn-words", "turn_words", int, "words of a long turn / a document"),
            ("--max-tokens", "max_tokens", int, "tokens per reply"),
            ("--salts", "salts", int, "cache_salt namespaces (each with a private document)"),
            ("--sample-every", "sample_every", int, "RSS / GPU memory sample every N requests"),
            ("--request-timeout", "request_timeout_s", float, "seconds per request"),
            ("--server-pid", "server_pid", int, "server process whose RSS (with its descendants) is followed"),
            ("--server-log", "server_log", str, "server log scanned for SGLang's idle memory-leak report"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    for flag, name, typ, doc in _OPTIONS:
        ap.add_argument(flag, dest=name, type=typ, default=getattr(SoakConfig, name), help=doc)
    ap.add_argument("--launch", help="comma-separated modes (or 'all'): start a server for each on a free port "
                                     "(off first), soak it, stop it by its process group; --url is then ignored")
    ap.add_argument("--model", default=str(Path(__file__).resolve().parents[1] / "models" / "SmolLM2-135M-Instruct"))
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra server argument for --launch (repeat; e.g. --server-arg=--max-total-tokens=4096)")
    ap.add_argument("--sparse-config", action="append", default=[], metavar="MODE=JSON",
                    help="with --launch: that mode's --sparse-config (repeat per mode; default: the mode's defaults)")
    ap.add_argument("--log-dir", default=".", help="where --launch writes the server logs")
    ap.add_argument("--reference-json", help="an off run's report: wrong_vs_off counts the items it got right")
    ap.add_argument("--repeat-off", action="store_true",
                    help="with --launch: soak a fresh off server again at the end ('off_repeat'); its wrong_vs_off is "
                         "the noise floor of the fact checks (batch nondeterminism of the dense server)")
    ap.add_argument("--out", help="report JSON path (default: stdout)")
    a = ap.parse_args(argv)
    try:
        cfg = SoakConfig(**{name: getattr(a, name) for _, name, _, _ in _OPTIONS})
    except ValueError as e:
        ap.error(str(e))
    reference = json.loads(Path(a.reference_json).read_text()) if a.reference_json else None
    if reference and "modes" in reference:
        reference = reference["modes"].get("off", reference)
    if a.launch:
        from sglang_sparse.modes import implemented_modes

        modes = implemented_modes() if a.launch == "all" else [m.strip() for m in a.launch.split(",") if m.strip()]
        if sorted(set(modes) - set(implemented_modes())):
            ap.error(f"--launch: unknown mode(s) {sorted(set(modes) - set(implemented_modes()))}; "
                     f"implemented: {implemented_modes()}")
        try:
            configs = parse_mode_configs(a.sparse_config, modes)
        except ValueError as e:
            ap.error(str(e))
        if a.repeat_off and "off" not in modes:
            ap.error("--repeat-off needs off in --launch (the repeat is compared with the first off run)")
        report = launch_and_run(modes, cfg, a.model, Path(a.log_dir), reference, a.server_arg, log=_log,
                                repeat_off=a.repeat_off, sparse_configs=configs)
    else:
        report = run_soak(cfg, reference=reference, log=_log)
    text = json.dumps(report, indent=1)
    if a.out:
        Path(a.out).write_text(text + "\n")
    else:
        print(text)
    return 0


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
