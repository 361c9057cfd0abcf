"""``--sparse samkv`` front door: the ``documents`` field of ``/v1/chat/completions`` and ``/v1/completions``.

API. ``extra_body={"documents": ["text 1", ...], "cache_salt": "s"?, "samkv": {"variant": ..., "layout": ...}?}``.
Layout ``in_user_turn`` (the default, chat requests): the documents go where a chat user puts them, inside
the last user turn after the template's header and before that turn's own text::

    [P: template tokens up to the last user turn's text] [tok(doc_1 + "\\n\\n")] ... [tok(doc_D + "\\n\\n")]
    [the user turn's text, the rest of the template]

and each document's KV is computed once behind the shared prefix ``P`` (the system prompt and the user header:
its prefill request is ``P + document``), so it is reusable in any order and position: the scheduler copies
``P``'s KV as is and re-rotates each document's keys to its place (APE / Block-Attention style). Layout
``before_prompt`` (and every ``/v1/completions`` request, which has no turns) places the documents before the
whole prompt, each prefilled alone from position 0. When the user turn's text cannot be found as a token
run of the templated prompt the request uses ``before_prompt`` and reports it (``layout`` in the response).

Each document is tokenised alone (no special tokens), so its token span is known and its tokens
are the same in every request: that is the per-document cache key. Validation (HTTP 400 naming
the field, the server keeps serving): :func:`sglang_sparse.documents.parse_documents` (non-empty
list of non-empty strings, count and character limits of the config), ``cache_salt`` a string,
``samkv.variant`` one of the config's variants, documents + prompt + ``max_tokens`` within the
model's context, no batch prompt. ``stream=true`` streams the reply like any SGLang stream (the
per-request report below is not in the chunks, the OpenAI stream format has no metadata field;
``stream_options.include_usage`` gives the composite context's ``prompt_tokens``).

Why this design (SGLang 0.5.17, no patched files): the radix tree is SGLang's KV store for
documents too. (1) Each document is prefilled alone, from position 0, by an internal generate
request (``max_new_tokens`` 1) whose ``extra_key`` is the document namespace
``samkv-doc:<secret>:<salt>`` (``secret``: 128 random bits drawn once per server process, so no client
request can name a document namespace, whatever ``extra_key`` / ``cache_salt`` it sends; no salt and ``""``
are the same, unsalted namespace); SGLang caches its KV under its own tokens + namespace, refcounted and evicted
like any radix node, and a cached document costs one token of compute; documents this front door
has seen cached (:class:`KnownDocuments`) skip that round trip (a stale belief costs a dense request,
after which they are prefilled again), and a document's text is tokenised once per server
(:class:`DocumentTokenCache`). Under page size p the
document's ids are followed by filler tokens up to a multiple of p so every document token sits in
a full, cached page (causal attention: the filler changes nothing before it). (2) The request itself
is sent with its token ids, the document spans in ``custom_params`` (flat int lists; values must
survive msgpack) and ``extra_key`` = a composite namespace ``samkv:<variant>:<salt>:<sha>`` that
dense requests never match. (3) In the scheduler, :mod:`sglang_sparse.samkv.assembly` builds the
composite context from the documents' cached KV (keys re-rotated by each document's offset, blocks
selected by SamKV) and inserts it into the tree under that namespace, so SGLang's own prefix match
makes it the request's prefix and only the question is extended. Salts live in both namespaces, so
different salts never share a document or a composite entry.

Response: ``metadata["sparse"]`` (non-streaming) = :func:`summarize`. Imports sglang lazily.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from array import array
from dataclasses import dataclass

from flashinfer_ext.samkv.score import kept_budget
from sglang_sparse.client_limits import MAX_KEY_CHARS, body_error
from sglang_sparse.documents import FIELD, parse_documents
# the custom_params contract read by samkv.assembly in the scheduler
from sglang_sparse.samkv.keys import FILLER_KEY, NS_KEY, PREFIX_KEY, SPANS_KEY, VARIANT_KEY, doc_key_ids

logger = logging.getLogger("sglang_sparse")

SEPARATOR = "\n\n"
FOLLOWER = "x"  # stands for the text that follows a document (the next document or the user's text)


def encode_followed(tokenizer, text: str, tail_ids: tuple[int, ...]) -> tuple[int, ...]:
    """Token ids of ``text`` as they stand when non-space text follows it, as in a stock prompt with the
    documents inlined: a byte-level BPE tokenises a trailing ``"\n\n"`` as one token at the end of a string
    but as two before a word, so ``tok(doc + "\n\n")`` alone would differ from what the inline prompt holds.
    ``tail_ids``: ``tok(FOLLOWER)``. Encodes ``text + FOLLOWER`` and drops the follower's ids; when the follower
    merges into ``text``'s last token (a tokenizer without that split), falls back to ``tok(text)``."""
    full = tokenizer.encode(text + FOLLOWER, add_special_tokens=False)
    n = len(tail_ids)
    if n and len(full) > n and tuple(full[-n:]) == tail_ids:
        return tuple(full[:-n])
    return tuple(tokenizer.encode(text, add_special_tokens=False))


@dataclass(frozen=True)
class DocumentPlan:
    """Token layout of one documents request (main process).

    doc_ids: per document, its token ids (``doc + SEPARATOR`` as tokenised before more text,
    :func:`encode_followed`); prompt_ids: the request's own
    prompt tokens after them; salt: the cache salt ('' if none); variant: the pipeline to run;
    prefix_ids: the template tokens before the documents (``P``; empty for ``before_prompt``), part of
    every document's prefill and of its cache identity.
    """

    doc_ids: tuple[tuple[int, ...], ...]
    prompt_ids: tuple[int, ...]
    salt: str
    variant: str
    doc_digests: tuple[str, ...] | None = None  # per document ids_digest(ids) (computed here when None)
    secret: str = ""  # the front door's namespace secret (:func:`_ns_secret`); part of every namespace
    prefix_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.doc_digests is None:
            object.__setattr__(self, "doc_digests", tuple(ids_digest(d) for d in self.doc_ids))
        elif len(self.doc_digests) != len(self.doc_ids):
            raise ValueError(f"DocumentPlan: {len(self.doc_digests)} digests for {len(self.doc_ids)} documents")

    @property
    def layout(self) -> str:
        return "in_user_turn" if self.prefix_ids else "before_prompt"

    def doc_prefill_ids(self, i: int, filler: int, page_size: int) -> list[int]:
        """Prefill ids of document ``i``: ``P + document``, padded to a page multiple."""
        return doc_key_ids(list(self.prefix_ids) + list(self.doc_ids[i]), filler, page_size)

    @property
    def input_ids(self) -> list[int]:
        out: list[int] = list(self.prefix_ids)
        for d in self.doc_ids:
            out.extend(d)
        out.extend(self.prompt_ids)
        return out

    @property
    def spans(self) -> list[int]:
        flat, pos = [], len(self.prefix_ids)
        for d in self.doc_ids:
            flat += [pos, len(d)]
            pos += len(d)
        return flat

    @property
    def document_tokens(self) -> int:
        return sum(len(d) for d in self.doc_ids)

    def doc_namespace(self) -> str:
        return f"samkv-doc:{self.secret}:{self.salt}"

    def prefix_digest(self) -> str:
        return ids_digest(self.prefix_ids) if self.prefix_ids else ""

    def composite_namespace(self, nonce: str) -> str:
        """Composite entries: per variant and salt, keyed by all ids (selection depends on the question);
        ``recompute`` gets a fresh nonce so the baseline never reuses anything."""
        h = hashlib.sha256(repr((self.prefix_ids, self.doc_digests, self.prompt_ids)).encode()).hexdigest()[:24]
        return f"samkv:{self.secret}:{self.variant}:{self.salt}:{h}" + (f":{nonce}" if self.variant == "recompute" else "")


def ids_digest(ids: tuple[int, ...] | list[int]) -> str:
    """sha256 (hex) of a document's token ids: its identity in :class:`KnownDocuments` and in the composite
    namespace (hashing the digests, not every id, of each request)."""
    return hashlib.sha256(repr(tuple(ids)).encode()).hexdigest()




def _parse_extra(body: dict, cfg) -> tuple[tuple[str, ...], str, str | None, str]:
    """``(documents, salt, variant, layout)`` of a documents request; ``variant`` is None when the request names
    none (:func:`choose_variant` picks it once the documents are tokenised). Raises ``ValueError`` naming the
    field."""
    docs = parse_documents(body.get(FIELD), max_documents=cfg.max_documents,
                           max_total_chars=cfg.max_document_chars)
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise ValueError(f"'cache_salt' must be a string, got {type(salt).__name__}")
    if salt is not None and len(salt) > MAX_SALT_CHARS:
        raise ValueError(f"'cache_salt' has {len(salt)} characters; at most {MAX_SALT_CHARS} are allowed "
                         "(it becomes part of every cache key of the request)")
    opts = body.get("samkv") or {}
    if not isinstance(opts, dict) or set(opts) - {"variant", "layout"}:
        raise ValueError("'samkv' must be an object with the keys 'variant' and / or 'layout'")
    variant = opts.get("variant")
    choices = type(cfg).__dataclass_fields__["variant"].metadata["choices"]
    if variant is not None and variant not in choices:
        raise ValueError(f"'samkv.variant'={variant!r} must be one of {', '.join(choices)}")
    layout = opts.get("layout", "in_user_turn")
    if layout not in LAYOUTS:
        raise ValueError(f"'samkv.layout'={layout!r} must be one of {', '.join(LAYOUTS)}")
    return docs, salt or "", variant, layout


def choose_variant(requested: str | None, doc_lengths: list[int], cfg) -> tuple[str, str | None]:
    """The pipeline of a documents request of documents of ``doc_lengths`` tokens, and why when it is not the
    server's ``variant``.

    A request that names its variant gets it. Otherwise the request is served by ``recompute`` (the stock inline
    prompt, dense) when its documents hold fewer than ``min_document_tokens`` tokens in all (the reuse saves
    little prefill, and its budget leaves a block or two of their middle, which lost planted facts the inline
    prompt answered), or when the kept budget holds fewer than ``min_middle_blocks`` middle blocks per document
    that has a middle (many short documents: the budget goes to their always-kept first and last blocks, and
    whatever sits between is dropped)."""
    if requested is not None:
        return requested, None
    if cfg.variant == "recompute":
        return cfg.variant, None
    tokens = sum(doc_lengths)
    if tokens < cfg.min_document_tokens:
        return "recompute", f"{tokens} document tokens, below min_document_tokens ({cfg.min_document_tokens})"
    if cfg.min_middle_blocks and cfg.variant == "samkv" and tokens:
        plan = kept_budget(list(doc_lengths), cfg.block_size, cfg.initial_blocks, cfg.local_blocks,
                           cfg.max_kept_ratio, cfg.anchor_share)
        if plan.middle_blocks < cfg.min_middle_blocks * plan.docs_with_middle:
            return "recompute", (f"the kept budget holds {plan.middle_blocks} middle blocks for "
                                 f"{plan.docs_with_middle} documents, below min_middle_blocks "
                                 f"({cfg.min_middle_blocks}) per document")
    return cfg.variant, None


LAYOUTS = ("in_user_turn", "before_prompt")
MAX_SALT_CHARS = MAX_KEY_CHARS  # a salt is part of every document and composite cache key


def split_user_turn(prompt_ids: list[int], content_ids: list[int]) -> int | None:
    """Where the last user turn's text starts in the templated prompt: the start of the last occurrence of
    ``content_ids`` as a token run of ``prompt_ids`` (None when absent or empty)."""
    n = len(content_ids)
    if n == 0 or n > len(prompt_ids):
        return None
    first = content_ids[0]
    for start in range(len(prompt_ids) - n, -1, -1):
        if prompt_ids[start] == first and prompt_ids[start:start + n] == content_ids:
            return start
    return None


def _last_user_text(request) -> str | None:
    """Text of the last ``user`` message of a chat request (None: not a chat request, or no text)."""
    for m in reversed(getattr(request, "messages", None) or []):
        role = m.get("role") if isinstance(m, dict) else getattr(m, "role", None)
        if role != "user":
            continue
        content = m.get("content") if isinstance(m, dict) else getattr(m, "content", None)
        if isinstance(content, str):
            return content
        if isinstance(content, list):  # OpenAI content parts: the text parts, in order
            parts = [(p.get("text") if isinstance(p, dict) else getattr(p, "text", None)) for p in content]
            return "".join(x for x in parts if isinstance(x, str)) or None
        return None
    return None


def _prompt_ids(serving, adapted) -> list[int]:
    if adapted.input_ids is not None:
        ids = adapted.input_ids
        if ids and isinstance(ids[0], list):
            raise ValueError(f"'{FIELD}' takes one prompt, not a batch")
        return list(ids)
    text = adapted.text
    if not isinstance(text, str):
        raise ValueError(f"'{FIELD}' takes one prompt, not a batch")
    return list(serving.tokenizer_manager.tokenizer.encode(text))


def summarize(plan: DocumentPlan, doc_cached: list[int], meta: dict, page_size: int = 1,
              variant_reason: str | None = None) -> dict:
    """``metadata["sparse"]`` of a documents request from the documents' prefill replies
    (``doc_cached``: cached tokens of each; -1 = known cached, not sent) and the request's ``meta_info``."""
    from sglang_sparse.samkv.assembly import kept_from_meta

    prompt = int(meta.get("prompt_tokens", 0))
    cached = int(meta.get("cached_tokens", 0))
    n_doc = plan.document_tokens
    kept = kept_from_meta(meta, n_doc, len(plan.prompt_ids) + len(plan.prefix_ids))
    sched = meta.get("samkv")
    sched = next((x for x in sched if isinstance(x, dict)), {}) if isinstance(sched, list) else {}
    ok = sched.get("status") == "assembled"
    reused = sum(1 for c, d in zip(doc_cached, plan.doc_ids) if (c < 0 and ok) or c >= len(d) - page_size)
    return {
        "mode": "samkv", "variant": plan.variant, "layout": plan.layout, "documents": len(plan.doc_ids),
        "variant_reason": variant_reason,  # why the request got another variant than the server's (None: it did not)
        "documents_reused": reused, "documents_prefilled": len(plan.doc_ids) - reused,
        "document_tokens": n_doc, "question_tokens": len(plan.prompt_ids), "prefix_tokens": len(plan.prefix_ids),
        "context_tokens": prompt, "cached_tokens": cached, "computed_tokens": prompt - cached,
        "kv_kept_tokens": kept, "kv_kept_ratio": kept / n_doc if n_doc else 1.0,
        "recomputed_tokens": int(sched.get("recomputed_tokens", 0)),
        "assembled": sched.get("status") == "assembled", "scheduler_status": sched.get("status"),
        "scheduler_reason": sched.get("reason"),  # why a fallback / error served it densely (None otherwise)
        "scheduler_ms": sched.get("timing_ms"),  # the scheduler's assembly phases (CUDA-synchronised)
        # which path ran each side forward: {"selection" / "recompute": "graph" | "pad" | "eager"} (None: none ran)
        "side_forward": sched.get("side_forward"),
        # the scheduler's assembly as [start, end] epoch seconds (None: none ran)
        "scheduler_wall_s": sched.get("wall_s"),
        # per document, the kept token ranges [start, end, start, end, ...] in the document's ids (None: no
        # assembly, e.g. recompute or a dense fallback)
        "kept_ranges": sched.get("kept_ranges") if ok else None,
    }


class KnownDocuments:
    """Documents this server's front door believes cached (LRU set of ``(namespace, sha of ids)``, at most
    ``capacity``), held on the server's tokenizer manager. Known documents skip their prefill round trip; when the
    scheduler reports a fallback (a document was evicted meanwhile) the request was served densely and
    its documents are forgotten, so the next request prefills them again."""

    def __init__(self, capacity: int = 65536):
        from collections import OrderedDict

        self.capacity = capacity
        self._keys: "OrderedDict[tuple[str, str], None]" = OrderedDict()

    @staticmethod
    def key(plan: DocumentPlan, i: int) -> tuple[str, str]:
        """Key of document ``i`` of ``plan``: (document namespace + digest of the prefix P, digest of its ids)."""
        return plan.doc_namespace() + ":" + plan.prefix_digest(), plan.doc_digests[i]

    def has(self, k) -> bool:
        if k in self._keys:
            self._keys.move_to_end(k)
            return True
        return False

    def add(self, k) -> None:
        self._keys[k] = None
        self._keys.move_to_end(k)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def drop(self, k) -> None:
        self._keys.pop(k, None)


class DocumentTokenCache:
    """Token ids of the documents this front door has tokenised, so a document is tokenised once: an LRU map
    ``sha256(text) -> (ids, ids_digest(ids))`` holding at most ``max_entries`` documents and ``max_tokens``
    ids in all (the least recently used go first; a document longer than ``max_tokens`` is not kept).
    The ids are kept as 4-byte ints (``array("i")``), so the cache holds at most about ``4 * max_tokens`` bytes
    of ids (32 MB at the defaults; a tuple of Python ints would take ~36 bytes an id). Held, like
    :class:`KnownDocuments`, on the server's tokenizer manager (one per server, shared by the chat
    and completion endpoints); the tokenizer is the server's, fixed for the cache's life."""

    def __init__(self, max_entries: int = 4096, max_tokens: int = 8_000_000):
        from collections import OrderedDict

        if max_entries < 1 or max_tokens < 1:
            raise ValueError(f"DocumentTokenCache: max_entries={max_entries}, max_tokens={max_tokens} must be >= 1")
        self.max_entries, self.max_tokens = int(max_entries), int(max_tokens)
        self._map: "OrderedDict[str, tuple[array, str]]" = OrderedDict()
        self.tokens = 0
        self.hits = self.misses = 0
        self._tail_ids: tuple[int, ...] | None = None  # tok(FOLLOWER), computed on first use

    @staticmethod
    def _key(text: str) -> str:
        return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()

    def encode(self, tokenizer, text: str, store: bool = True) -> tuple[tuple[int, ...], str]:
        """``(ids, ids_digest(ids))`` of ``text`` as it is tokenised inside a longer text (:func:`encode_followed`),
        from the cache when this text was tokenised before. ``store=False``: do not keep a new result (the caller
        :meth:`keep` s it once the request is accepted, so refused requests hold no memory)."""
        key = self._key(text)
        hit = self._map.get(key)
        if hit is not None:
            self._map.move_to_end(key)
            self.hits += 1
            return tuple(hit[0]), hit[1]
        self.misses += 1
        if self._tail_ids is None:
            self._tail_ids = tuple(tokenizer.encode(FOLLOWER, add_special_tokens=False))
        ids = encode_followed(tokenizer, text, self._tail_ids)
        val = (ids, ids_digest(ids))
        if store:
            self.keep(text, val)
        return val

    def keep(self, text: str, val: tuple[tuple[int, ...], str]) -> None:
        """Keep ``val`` (from :meth:`encode`) for ``text``, evicting the least recently used beyond the limits."""
        key = self._key(text)
        ids = val[0]
        if key in self._map:
            self._map.move_to_end(key)
            return
        if len(ids) <= self.max_tokens:
            self._map[key] = (array("i", ids), val[1])
            self.tokens += len(ids)
            while len(self._map) > self.max_entries or self.tokens > self.max_tokens:
                _, (old, _) = self._map.popitem(last=False)
                self.tokens -= len(old)

    def nbytes(self) -> int:
        """Bytes of the ids held (4 per id)."""
        return sum(a.itemsize * len(a) for a, _ in self._map.values())

    def __len__(self) -> int:
        return len(self._map)


def _state(serving, name: str, factory):
    """The front door's per-server object ``name`` (created on first use), held on the tokenizer manager."""
    owner = serving.tokenizer_manager
    obj = getattr(owner, name, None)
    if obj is None:
        obj = factory()
        setattr(owner, name, obj)
    return obj


def _ns_secret(serving) -> str:
    """128 random bits, drawn once per server process: the part of the cache namespaces no client can send."""
    import secrets

    return _state(serving, "samkv_ns_secret", lambda: secrets.token_hex(16))


def _known(serving) -> KnownDocuments:
    return _state(serving, "samkv_known_documents", KnownDocuments)


def _token_cache(serving) -> DocumentTokenCache:
    return _state(serving, "samkv_document_tokens", DocumentTokenCache)


async def _prefill_documents(serving, plan: DocumentPlan, filler: int, page_size: int, raw_request,
                             todo: list[int]) -> dict[int, int]:
    """Prefill documents ``todo`` alone (cached ones cost one token); returns each one's cached tokens."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    async def one(ids):
        req = GenerateReqInput(input_ids=ids, extra_key=plan.doc_namespace(),
                               sampling_params={"max_new_tokens": 1, "temperature": 0.0}, stream=False)
        ret = await serving.tokenizer_manager.generate_request(req, raw_request).__anext__()
        # cached tokens of the document itself (the shared prefix P is cached after the first document)
        return max(0, int(ret["meta_info"].get("cached_tokens", 0)) - len(plan.prefix_ids))

    got = await asyncio.gather(*(one(plan.doc_prefill_ids(i, filler, page_size)) for i in todo))
    return dict(zip(todo, got))


async def handle_request_hook(original, serving, request, raw_request, *args, **kwargs):
    """AROUND ``OpenAIServingBase.handle_request``: requests with ``documents`` under ``--sparse samkv``
    (under any other mode they are a 400, not silently dropped); every other request passes through once
    its client limits hold (:func:`sglang_sparse.client_limits.body_error`, every mode)."""
    from sglang.srt.server_args import get_global_server_args

    from sglang_sparse.modes import sparse_context_of

    ctx = sparse_context_of(get_global_server_args())
    body = None
    if raw_request is not None and type(serving).__name__ in ("OpenAIServingChat", "OpenAIServingCompletion"):
        try:
            body = await raw_request.json()  # parsed once by FastAPI already (cached)
        except Exception:
            body = None
    limit = body_error(body)  # every mode: cache_salt / extra_key length, reserved custom_params keys
    if limit is not None:
        return serving.create_error_response(message=limit[0], err_type="BadRequest", status_code=400,
                                             param=limit[1])
    if not isinstance(body, dict) or FIELD not in body:
        return await original(serving, request, raw_request, *args, **kwargs)
    if ctx.mode != "samkv":  # never drop the documents in silence
        return serving.create_error_response(
            message=f"'{FIELD}' needs a server started with --sparse samkv (this one runs '{ctx.mode}')",
            err_type="BadRequest", status_code=400)
    received = time.monotonic()
    try:
        return await _serve_documents(serving, request, raw_request, body, ctx.config, received)
    except ValueError as e:
        return serving.create_error_response(message=str(e), err_type="BadRequest", status_code=400)


async def _serve_documents(serving, request, raw_request, body, cfg, received):
    import uuid

    from sglang.srt.server_args import get_global_server_args

    docs, salt, requested, layout = _parse_extra(body, cfg)
    stream = bool(getattr(request, "stream", False))
    err = serving._validate_request(request)
    if err:
        raise ValueError(err)
    adapted, processed = serving._convert_to_internal_request(request, raw_request)
    tok = serving.tokenizer_manager.tokenizer
    front_ms = {}
    t0 = time.perf_counter()
    cache = _token_cache(serving)
    # each document tokenised once per server; kept only after the request passes the length check below
    encoded = [cache.encode(tok, d + SEPARATOR, store=False) for d in docs]
    doc_ids = tuple(e[0] for e in encoded)
    prompt = _prompt_ids(serving, adapted)
    cut = None
    if layout == "in_user_turn":
        text = _last_user_text(request)
        if text:
            cut = split_user_turn(prompt, list(tok.encode(text, add_special_tokens=False)))
        if cut is None:
            logger.info("sglang-sparse samkv: no user turn text found in the templated prompt; documents go "
                        "before the prompt")
    variant, variant_reason = choose_variant(requested, [len(d) for d in doc_ids], cfg)
    plan = DocumentPlan(doc_ids, tuple(prompt[cut or 0:]), salt, variant,
                        doc_digests=tuple(e[1] for e in encoded), secret=_ns_secret(serving),
                        prefix_ids=tuple(prompt[:cut or 0]))
    front_ms["tokenize"] = round(1000.0 * (time.perf_counter() - t0), 3)
    ctx_len = serving.tokenizer_manager.context_len
    max_new = (adapted.sampling_params or {}).get("max_new_tokens") or 0
    if len(plan.input_ids) + max_new > ctx_len:
        raise ValueError(f"'{FIELD}' is too long for the context: {plan.document_tokens} document tokens + "
                         f"{len(plan.prompt_ids) + len(plan.prefix_ids)} prompt tokens + {max_new} max tokens "
                         f"exceed the model's "
                         f"context of {ctx_len} tokens")
    for d, e in zip(docs, encoded):
        cache.keep(d + SEPARATOR, e)
    page = max(1, int(get_global_server_args().page_size or 1))
    filler = int(getattr(tok, "eos_token_id", None) or 0)
    doc_cached = [0] * len(doc_ids)  # -1: known cached, no prefill round trip
    known, keys = _known(serving), [KnownDocuments.key(plan, i) for i in range(len(doc_ids))]
    if variant != "recompute":
        todo = [i for i, k in enumerate(keys) if not known.has(k)]
        t0 = time.perf_counter()
        got = await _prefill_documents(serving, plan, filler, page, raw_request, todo) if todo else {}
        doc_cached = [got.get(i, -1) for i in range(len(doc_ids))]
        front_ms["document_prefill"] = round(1000.0 * (time.perf_counter() - t0), 3)
    adapted.text = None
    adapted.input_ids = plan.input_ids
    adapted.extra_key = plan.composite_namespace(uuid.uuid4().hex)
    sp = dict(adapted.sampling_params or {})
    custom = dict(sp.get("custom_params") or {})
    custom.update({SPANS_KEY: plan.spans, NS_KEY: plan.doc_namespace(), FILLER_KEY: [filler, page],
                   VARIANT_KEY: variant, PREFIX_KEY: len(plan.prefix_ids)})
    sp["custom_params"] = custom
    adapted.sampling_params = sp
    adapted.received_time = received
    if stream:  # SGLang's own stream over the composite request; documents stay "unknown" to this front door
        # (a fallback in the scheduler is not seen here), so the next request re-checks them: one cached token
        return await serving._handle_streaming_request(adapted, processed, raw_request)
    t0 = time.perf_counter()
    ret = await serving.tokenizer_manager.generate_request(adapted, raw_request).__anext__()
    ret = ret if isinstance(ret, list) else [ret]
    front_ms["generate"] = round(1000.0 * (time.perf_counter() - t0), 3)
    build = getattr(serving, "_build_chat_response", None) or serving._build_completion_response
    response = build(processed, ret, int(time.time()))
    summaries = [summarize(plan, doc_cached, item.get("meta_info") or {}, page, variant_reason) for item in ret]
    front_ms["total"] = round(1000.0 * (time.monotonic() - received), 3)
    for x in summaries:  # front door phases: tokenize, document prefill round trips, the generate call
        x["front_ms"] = front_ms
    if variant != "recompute":
        fell_back = any(x["scheduler_status"] in ("fallback", "error") for x in summaries)
        for k in keys:
            known.drop(k) if fell_back else known.add(k)
    if hasattr(response, "metadata"):
        response.metadata = {**(response.metadata or {}),
                             "sparse": summaries[0] if len(summaries) == 1 else summaries}
    return response
