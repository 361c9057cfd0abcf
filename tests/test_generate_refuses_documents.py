"""Contract: ``documents`` sent to SGLang's native ``/generate`` is answered with HTTP 400 naming the routes that
serve documents (never a 200 that ignores them), streaming or not; other ``/generate`` bodies pass unchanged."""

from __future__ import annotations

import asyncio
import json

import pytest
import requests

from sglang_sparse.http_guard import NativeFieldGuard, install, refusal


def _call(app, path: str, body: bytes, chunk: int = 7) -> tuple[int, bytes, bytes]:
    """Drive an ASGI app with one POST (body split into chunks); returns (status, body sent, body the app got)."""
    parts = [body[i:i + chunk] for i in range(0, len(body), chunk)] or [b""]
    messages = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)]
    sent, seen = [], {}

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(msg):
        sent.append(msg)

    async def inner(scope, receive, send):
        got, more = b"", True
        while more:
            m = await receive()
            got += m.get("body", b"")
            more = m.get("more_body", False)
        seen["body"] = got
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    scope = {"type": "http", "method": "POST", "path": path, "headers": []}
    asyncio.run(NativeFieldGuard(inner)(scope, receive, send) if app is None else app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"), seen.get("body")


def test_guard_refuses_documents_on_generate_and_replays_other_bodies_unchanged():
    bad = json.dumps({"text": "hi", "documents": ["a doc"], "sampling_params": {"max_new_tokens": 2}}).encode()
    status, out, _ = _call(None, "/generate", bad)
    assert status == 400
    msg = json.loads(out)["message"]
    assert "'documents'" in msg and "/v1/chat/completions" in msg and "/v1/completions" in msg
    good = json.dumps({"text": 'a prompt that says "documents"', "sampling_params": {"max_new_tokens": 2}}).encode()
    assert _call(None, "/generate", good) == (200, b"ok", good)
    assert _call(None, "/v1/chat/completions", bad) == (200, b"ok", bad)  # the OpenAI routes decide themselves
    assert refusal(b"{not json") is None and refusal(b'["documents"]') is None


def test_install_adds_the_guard_once_and_only_before_the_app_starts():
    from fastapi import FastAPI

    app = FastAPI()
    assert install(app) and install(app)
    assert sum(m.cls is NativeFieldGuard for m in app.user_middleware) == 1
    started = FastAPI()
    started.middleware_stack = started.build_middleware_stack()
    assert not install(started)


def test_cpu_server_answers_400_for_documents_on_generate(cpu_server):
    body = {"text": "The capital of France is", "documents": ["Paris is the capital of France."],
            "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    r = requests.post(cpu_server.url + "/generate", json=body, timeout=120)
    assert r.status_code == 400, r.text
    assert "/v1/chat/completions" in r.json()["message"]
    r = requests.post(cpu_server.url + "/generate", json={**body, "stream": True}, timeout=120)
    assert r.status_code == 400, r.text
    del body["documents"]
    r = requests.post(cpu_server.url + "/generate", json=body, timeout=120)
    assert r.status_code == 200 and r.json()["text"], r.text
