"""Validation of the ``documents`` request field of the samkv mode.

API: ``/v1/chat/completions`` and ``/v1/completions`` accept
``extra_body={"documents": ["text of doc 1", "text of doc 2", ...]}``; each document's KV is
prefilled alone and cached per document. This module only checks the payload's shape and size:
a non-empty list of non-empty strings, at most ``max_documents`` items and at most
``max_total_chars`` characters in all. Every refusal is a ``ValueError`` whose message names the
field (``documents`` / ``documents[i]``), the offending index or value and the limit, so the server
can answer it as HTTP 400 as is.

Cautions: limits are in characters, not tokens (the context-length check against the tokenised
documents belongs to the server wiring, after tokenisation). Strings made only of whitespace are
refused as empty. Tuples are refused like any other non-list (JSON only yields lists). Imports
nothing from sglang.
"""

from __future__ import annotations

from typing import Any

__all__ = ["FIELD", "parse_documents"]

FIELD = "documents"


def _check_limit(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"parse_documents: {name}={value!r} must be an integer >= 1")
    return value


def parse_documents(raw: Any, *, max_documents: int, max_total_chars: int) -> tuple[str, ...]:
    """Validate ``extra_body["documents"]`` and return the documents as a tuple of strings.

    raw: the decoded JSON value of the field. Returns the strings unchanged (no stripping), in order.
    Raises ``ValueError`` naming the field, index and limit when ``raw`` is not a list, is empty,
    holds more than ``max_documents`` items, holds a non-string or an empty (or whitespace-only)
    string, or when the documents' characters sum to more than ``max_total_chars``.
    """
    max_documents = _check_limit("max_documents", max_documents)
    max_total_chars = _check_limit("max_total_chars", max_total_chars)
    if not isinstance(raw, list):
        raise ValueError(f"'{FIELD}' must be a list of strings (one per document), got "
                         f"{type(raw).__name__}")
    if not raw:
        raise ValueError(f"'{FIELD}' must hold at least one document, got an empty list")
    if len(raw) > max_documents:
        raise ValueError(f"'{FIELD}' holds {len(raw)} documents; at most {max_documents} are allowed")
    total = 0
    for i, doc in enumerate(raw):
        if not isinstance(doc, str):
            raise ValueError(f"'{FIELD}[{i}]' must be a string, got {type(doc).__name__}")
        if not doc.strip():
            raise ValueError(f"'{FIELD}[{i}]' is empty; every document needs non-whitespace text")
        total += len(doc)
        if total > max_total_chars:
            raise ValueError(f"'{FIELD}' is too long: {total} characters up to '{FIELD}[{i}]' "
                             f"exceed the limit of {max_total_chars} characters in all")
    return tuple(raw)
