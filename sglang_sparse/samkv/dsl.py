"""SGLang frontend DSL helper for ``--sparse samkv``: generate over documents from an ``@sgl.function``.

SGLang's DSL talks to the server through the native ``/generate``, which has no ``documents`` field;
:func:`gen_with_documents` sends the program's text so far as the prompt of ``/v1/completions`` with
the documents (the OpenAI front door of :mod:`sglang_sparse.samkv.api`), appends the completion to
the program state and stores it under ``name``. Use it where ``sgl.gen(name)`` would go::

    @sgl.function
    def qa(s, docs, question):
        s += "Question: " + question + "\\nAnswer:"
        gen_with_documents(s, "answer", docs, max_tokens=16)

    state = qa.run(docs=[...], question="...", backend=sgl.RuntimeEndpoint(url))
    state["answer"], state.get_var("answer_sparse")   # text, metadata["sparse"]

Works with ``sgl.RuntimeEndpoint`` backends (it reads ``base_url`` / ``api_key``). Greedy by default.
"""

from __future__ import annotations

from typing import Any


def gen_with_documents(s, name: str, documents: list[str], *, max_tokens: int = 64, temperature: float = 0.0,
                       stop: list[str] | str | None = None, cache_salt: str | None = None,
                       variant: str | None = None, timeout: float = 600.0) -> dict[str, Any]:
    """Complete ``s``'s text over ``documents``; ``s[name]`` = the completion, ``s[name + "_sparse"]`` = its
    ``metadata["sparse"]`` (returned too). Raises ``ValueError`` with the server's message on HTTP 400."""
    import requests

    backend = s.stream_executor.backend
    url = getattr(backend, "base_url", None)
    if not url:
        raise TypeError("gen_with_documents needs an sgl.RuntimeEndpoint backend (with base_url)")
    body: dict[str, Any] = {"model": "default", "prompt": s.text(), "documents": list(documents),
                            "max_tokens": max_tokens, "temperature": temperature}
    if stop is not None:
        body["stop"] = stop
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    if variant is not None:
        body["samkv"] = {"variant": variant}
    headers = {"Authorization": f"Bearer {backend.api_key}"} if getattr(backend, "api_key", None) else {}
    r = requests.post(url + "/v1/completions", json=body, headers=headers, timeout=timeout)
    if r.status_code == 400:
        raise ValueError(r.json().get("message", r.text))
    r.raise_for_status()
    out = r.json()
    text = out["choices"][0]["text"]
    meta = (out.get("metadata") or {}).get("sparse") or {}
    s += text
    s.set_var(name, text)
    s.set_var(name + "_sparse", meta)
    return meta
