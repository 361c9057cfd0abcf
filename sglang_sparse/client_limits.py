"""Limits on request fields a client controls and the server keeps or keys caches by, checked in the main
process before a request is tokenised (HTTP 400 naming the field; the server keeps serving).

* ``cache_salt`` and ``extra_key`` (OpenAI routes; ``extra_key`` on the native ``/generate``): SGLang makes them
  part of every radix-cache key of the request, so each is at most :data:`MAX_KEY_CHARS` characters (a string,
  or a list of strings for batch prompts).
* ``custom_params`` keys starting with :data:`RESERVED_PREFIX` are the samkv front door's own instructions to
  the scheduler (document spans, namespaces; :mod:`sglang_sparse.samkv.api`): a client may not send them.

Used by :func:`sglang_sparse.samkv.api.handle_request_hook` (``/v1/chat/completions``, ``/v1/completions``,
every mode) and :mod:`sglang_sparse.http_guard` (``/generate``). The documents' own limits (count,
characters) are the samkv config's (:func:`sglang_sparse.documents.parse_documents`). No sglang import.
"""

from __future__ import annotations

from typing import Any

MAX_KEY_CHARS = 256
KEY_FIELDS = ("cache_salt", "extra_key")
RESERVED_PREFIX = "samkv_"


def _key_error(name: str, value: Any) -> str | None:
    items = value if isinstance(value, list) else [value]
    for i, v in enumerate(items):
        where = f"'{name}'" if not isinstance(value, list) else f"'{name}[{i}]'"
        if v is None:
            continue
        if not isinstance(v, str):
            return f"{where} must be a string, got {type(v).__name__}"
        if len(v) > MAX_KEY_CHARS:
            return (f"{where} has {len(v)} characters; at most {MAX_KEY_CHARS} are allowed (it becomes part of "
                    "every cache key of the request)")
    return None


def _custom_error(where: str, custom: Any) -> str | None:
    if not isinstance(custom, dict):
        return None
    reserved = sorted(k for k in custom if isinstance(k, str) and k.startswith(RESERVED_PREFIX))
    if reserved:
        return (f"'{where}' key(s) {', '.join(map(repr, reserved))}: keys starting with '{RESERVED_PREFIX}' are "
                "reserved for the server's documents front door; send documents in 'documents'")
    return None


def body_error(body: Any, native: bool = False) -> tuple[str, str] | None:
    """``(message, field)`` for the first client limit ``body`` (a decoded JSON request body) breaks, else None.
    ``native``: a ``/generate`` body (``extra_key``, ``sampling_params.custom_params``); otherwise an OpenAI
    body (``cache_salt``, ``extra_key``, ``custom_params``)."""
    if not isinstance(body, dict):
        return None
    for name in (("extra_key",) if native else KEY_FIELDS):
        if name in body:
            err = _key_error(name, body[name])
            if err:
                return err, name
    if native:
        sps = body.get("sampling_params")
        for sp in (sps if isinstance(sps, list) else [sps]):
            err = _custom_error("sampling_params.custom_params", sp.get("custom_params")) \
                if isinstance(sp, dict) else None
            if err:
                return err, "sampling_params.custom_params"
        return None
    err = _custom_error("custom_params", body.get("custom_params"))
    return (err, "custom_params") if err else None
