"""Refusals on SGLang's native HTTP routes for fields that only the OpenAI routes serve.

``documents`` (the SamKV documents API, :mod:`sglang_sparse.samkv.api`) is read by the
``/v1/chat/completions`` and ``/v1/completions`` front door. SGLang's native ``/generate`` decodes
its body into ``GenerateReqInput``, which drops unknown keys, so a ``documents`` field sent there
would be ignored in silence (200, an answer without the documents). :class:`NativeFieldGuard`, an
ASGI middleware added to SGLang's FastAPI app before it starts, answers such a request with HTTP
400 naming the field and the routes that serve it, under every ``--sparse`` mode, streaming or not.
It also answers 400 for a ``/generate`` body that breaks a client limit
(:mod:`sglang_sparse.client_limits`: ``extra_key`` length, reserved ``custom_params`` keys).

Installed by :func:`tokenizer_manager_init_hook` (AFTER ``TokenizerManager.__init__``, main process:
the HTTP server creates its tokenizer manager before it starts serving); a process without the
HTTP server module loaded (``sgl.Engine``) is left alone. Other bodies pass through unchanged (the
middleware buffers a ``/generate`` body once and replays it; a body without the bytes
``"documents"``, ``"extra_key"`` or ``"custom_params"`` is not parsed). No sglang import at module level.
"""

from __future__ import annotations

import json
import logging
import sys

logger = logging.getLogger("sglang_sparse")

GUARDED_PATHS = ("/generate",)
FIELD = "documents"
MESSAGE = ("'documents' is not a field of /generate (it would be ignored): send documents to "
           "/v1/chat/completions or /v1/completions (served by --sparse samkv), or put their text in the prompt")


_TRIGGERS = (f'"{FIELD}"'.encode(), b'"extra_key"', b'"custom_params"')


def refusal(body: bytes) -> str | None:
    """The 400 message for a native request body carrying ``documents`` (a JSON object key) or breaking a
    client limit (:func:`sglang_sparse.client_limits.body_error`), else None."""
    got = refusal_field(body)
    return None if got is None else got[0]


def refusal_field(body: bytes) -> tuple[str, str] | None:
    """``(message, field)`` of :func:`refusal`; bodies without the bytes of a checked key are not parsed."""
    if not any(t in body for t in _TRIGGERS):
        return None
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None  # SGLang answers bad JSON itself
    if not isinstance(obj, dict):
        return None
    if FIELD in obj:
        return MESSAGE, FIELD
    from sglang_sparse.client_limits import body_error

    return body_error(obj, native=True)


class NativeFieldGuard:
    """ASGI middleware: HTTP 400 for ``documents`` on :data:`GUARDED_PATHS`; everything else passes."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http" or scope.get("path") not in GUARDED_PATHS \
                or scope.get("method") not in ("POST", "PUT"):
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # client went away: let SGLang see it
                return await self.app(scope, _replay([b"".join(chunks)] if chunks else [], message, receive), send)
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        got = refusal_field(body)
        if got is None:
            return await self.app(scope, _replay([body], None, receive), send)
        payload = json.dumps({"object": "error", "message": got[0], "type": "BadRequest", "param": got[1],
                              "code": 400}).encode()
        await send({"type": "http.response.start", "status": 400,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})


def _replay(bodies: list[bytes], last, receive):
    """A ``receive`` that yields the buffered body once (then ``last``, if any), then the real channel."""
    queue = [{"type": "http.request", "body": b, "more_body": False} for b in bodies]
    if last is not None:
        queue.append(last)

    async def replay():
        return queue.pop(0) if queue else await receive()

    return replay


def install(app) -> bool:
    """Add :class:`NativeFieldGuard` to a FastAPI app that has not started; False if it cannot (logged)."""
    if getattr(app.state, "sparse_native_guard", False):
        return True
    if getattr(app, "middleware_stack", None) is not None:
        logger.warning("sglang-sparse: the HTTP app already runs; 'documents' on /generate is not refused")
        return False
    app.add_middleware(NativeFieldGuard)
    app.state.sparse_native_guard = True
    return True


def tokenizer_manager_init_hook(result, *args, **kwargs):
    """AFTER ``TokenizerManager.__init__``: guard the HTTP server's app if this process serves HTTP."""
    http = sys.modules.get("sglang.srt.entrypoints.http_server")
    if http is not None and getattr(http, "app", None) is not None:
        install(http.app)
    return result
