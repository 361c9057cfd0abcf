"""Contract (no server): the samkv front door tokenises each document text once per server, within its
bounds, and its per-document identities (digests) keep the cache keys and composite namespaces a function
of the token ids."""

from __future__ import annotations

import pytest

from sglang_sparse.samkv.api import DocumentPlan, DocumentTokenCache, KnownDocuments, ids_digest


class CountingTokenizer:
    """One token per character (its code point); counts encode calls."""

    def __init__(self):
        self.calls = 0

    def encode(self, text, add_special_tokens=True):
        assert add_special_tokens is False
        self.calls += 1
        return [ord(c) for c in text]


def test_document_token_cache_tokenizes_each_text_once():
    tok, cache = CountingTokenizer(), DocumentTokenCache(max_entries=8, max_tokens=1000)
    ids, digest = cache.encode(tok, "abc\n\n")
    assert ids == tuple(ord(c) for c in "abc\n\n") and digest == ids_digest(ids)
    assert tok.calls == 2  # the follower's ids once per cache, then the text
    assert cache.encode(tok, "abc\n\n") == (ids, digest) and tok.calls == 2
    assert cache.encode(tok, "abd\n\n")[0] != ids and tok.calls == 3
    assert (cache.hits, cache.misses) == (1, 2)


def test_document_token_cache_stays_within_entry_and_token_bounds():
    tok, cache = CountingTokenizer(), DocumentTokenCache(max_entries=3, max_tokens=10)
    for t in ("aaaa", "bbbb"):
        cache.encode(tok, t)
    cache.encode(tok, "aaaa")            # a is now the most recent
    cache.encode(tok, "cccc")            # 12 tokens > 10: the least recent (b) goes
    assert len(cache) == 2 and cache.tokens == 8
    calls = tok.calls
    cache.encode(tok, "aaaa")
    assert tok.calls == calls            # a survived
    cache.encode(tok, "bbbb")
    assert tok.calls == calls + 1        # b was evicted and is tokenised again
    cache.encode(tok, "x" * 11)          # longer than the whole budget: served, not kept
    assert cache.tokens <= 10 and len(cache) <= 3
    with pytest.raises(ValueError):
        DocumentTokenCache(max_entries=0)


def test_plan_identities_are_functions_of_the_token_ids():
    a = DocumentPlan(((1, 2, 3), (4, 5)), (9,), "s", "samkv")
    b = DocumentPlan(((1, 2, 3), (4, 5)), (9,), "s", "samkv", doc_digests=(ids_digest((1, 2, 3)), ids_digest((4, 5))))
    c = DocumentPlan(((1, 2, 3), (4, 6)), (9,), "s", "samkv")
    assert a.composite_namespace("n") == b.composite_namespace("n") != c.composite_namespace("n")
    assert KnownDocuments.key(a, 1) == KnownDocuments.key(b, 1) != KnownDocuments.key(c, 1)
    assert KnownDocuments.key(a, 0) == KnownDocuments.key(c, 0)
    # the recompute baseline never shares a composite; another salt never shares a document
    r = DocumentPlan(a.doc_ids, a.prompt_ids, "s", "recompute")
    assert r.composite_namespace("n1") != r.composite_namespace("n2")
    assert KnownDocuments.key(DocumentPlan(a.doc_ids, a.prompt_ids, "t", "samkv"), 0) != KnownDocuments.key(a, 0)
    with pytest.raises(ValueError):
        DocumentPlan(a.doc_ids, a.prompt_ids, "s", "samkv", doc_digests=("x",))


def test_repeated_documents_requests_keep_the_front_door_token_cache_within_its_byte_bound():
    """The token cache holds each id in 4 bytes (about 4 * max_tokens bytes at most: 32 MB at the defaults), not
    as Python ints (~36 bytes an id: ~290 MB at 8M tokens), and its memory stops growing at the token bound
    however many distinct documents come through."""
    import tracemalloc

    class WideTokenizer:  # ids above the small-int cache, as real vocabularies give
        def encode(self, text, add_special_tokens=False):
            return [40000 + (ord(c) * 7 + i) % 9000 for i, c in enumerate(text)]

    tok, cache = WideTokenizer(), DocumentTokenCache(max_entries=4096, max_tokens=200_000)
    tracemalloc.start()
    try:
        for i in range(100):                       # 100 documents of 4000 ids: twice the token bound
            ids, _ = cache.encode(tok, f"document {i} " + "w" * 3988)
        size, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert cache.tokens <= 200_000 and len(cache) == 50 and cache.nbytes() == 4 * cache.tokens
    assert size < 6 * 200_000 + 200_000, size      # ids at 4 B each plus keys and bookkeeping
    assert isinstance(ids, tuple) and cache.encode(tok, f"document {99} " + "w" * 3988)[0] == ids


def test_refused_documents_are_not_kept_in_the_token_cache():
    """A document tokenised for a request that is then refused (e.g. too long for the context) holds no memory:
    the front door encodes with ``store=False`` and keeps the ids only once the request is accepted."""
    tok, cache = CountingTokenizer(), DocumentTokenCache(max_entries=8, max_tokens=1000)
    val = cache.encode(tok, "abc\n\n", store=False)
    assert len(cache) == 0 and cache.tokens == 0
    cache.keep("abc\n\n", val)
    assert len(cache) == 1 and cache.encode(tok, "abc\n\n") == val and tok.calls == 2  # follower + text


def test_document_namespaces_carry_the_server_secret_a_client_cannot_send():
    """Isolation cannot be forged: every document and composite namespace holds the front door's random secret,
    so a plain request whose ``extra_key`` / ``cache_salt`` is ``samkv-doc:<salt>`` names no document entry."""
    a = DocumentPlan(((1, 2, 3),), (9,), "tenantX", "samkv", secret="s3cr3t")
    assert a.doc_namespace() == "samkv-doc:s3cr3t:tenantX" != "samkv-doc:tenantX"
    assert "s3cr3t" in a.composite_namespace("n")
    b = DocumentPlan(((1, 2, 3),), (9,), "tenantX", "samkv", secret="other")
    assert a.doc_namespace() != b.doc_namespace() and KnownDocuments.key(a, 0) != KnownDocuments.key(b, 0)


def test_documents_go_inside_the_last_user_turn_behind_the_template_prefix():
    """The user turn's text is found as a token run of the templated prompt (its last occurrence); the plan puts
    the documents between the template prefix P and that text, and every document's prefill is ``P + document``."""
    from sglang_sparse.samkv.api import split_user_turn

    prompt = [1, 50, 2, 60, 61, 3, 1, 70, 2, 80, 81, 82, 3, 1, 90, 2]  # ... <user header> 80 81 82 <end> ...
    assert split_user_turn(prompt, [80, 81, 82]) == 9
    assert split_user_turn(prompt + [80, 81, 82], [80, 81, 82]) == 16   # the last occurrence wins
    assert split_user_turn(prompt, [80, 99]) is None and split_user_turn(prompt, []) is None
    plan = DocumentPlan(((5, 6), (7,)), tuple(prompt[9:]), "s", "samkv", prefix_ids=tuple(prompt[:9]))
    assert plan.layout == "in_user_turn"
    assert plan.input_ids == prompt[:9] + [5, 6, 7] + prompt[9:]
    assert plan.spans == [9, 2, 11, 1]
    assert plan.doc_prefill_ids(1, filler=0, page_size=4) == prompt[:9] + [7] + [0, 0]
    # the prefix is part of each document's identity: another system prompt is another cache entry
    other = DocumentPlan(plan.doc_ids, plan.prompt_ids, "s", "samkv", prefix_ids=(1, 51) + tuple(prompt[2:9]))
    assert KnownDocuments.key(plan, 0) != KnownDocuments.key(other, 0)
    before = DocumentPlan(plan.doc_ids, tuple(prompt), "s", "samkv")
    assert before.layout == "before_prompt" and before.spans == [0, 2, 2, 1]


def test_last_user_text_reads_strings_and_text_parts():
    from sglang_sparse.samkv.api import _last_user_text

    class Req:
        messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "first"},
                    {"role": "assistant", "content": "a"},
                    {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "x?"}]},
                    {"role": "assistant", "content": "The answer is"}]

    assert _last_user_text(Req()) == "What is x?"
    assert _last_user_text(object()) is None


def test_cache_salt_and_layout_are_bounded_with_clear_errors():
    from sglang_sparse.config import SamKVConfig
    from sglang_sparse.samkv.api import MAX_SALT_CHARS, _parse_extra

    cfg = SamKVConfig()
    docs, salt, variant, layout = _parse_extra({"documents": ["a"], "cache_salt": "t" * MAX_SALT_CHARS}, cfg)
    assert salt == "t" * MAX_SALT_CHARS and variant is None and layout == "in_user_turn"  # none named
    assert _parse_extra({"documents": ["a"], "samkv": {"variant": "reuse"}}, cfg)[2] == "reuse"
    with pytest.raises(ValueError, match="'cache_salt' has 1000000 characters; at most 256"):
        _parse_extra({"documents": ["a"], "cache_salt": "x" * 1_000_000}, cfg)
    with pytest.raises(ValueError, match="'samkv.layout'='sideways' must be one of in_user_turn, before_prompt"):
        _parse_extra({"documents": ["a"], "samkv": {"layout": "sideways"}}, cfg)


@pytest.mark.parametrize("requested,lengths,cfg_kw,want", [
    (None, [4095], {}, ("recompute", "4095 document tokens, below min_document_tokens (4096)")),
    (None, [4096], {}, ("samkv", None)),                       # at the threshold: the server's variant
    ("samkv", [10], {}, ("samkv", None)),                      # a named variant is served as named
    ("cacheblend", [10], {}, ("cacheblend", None)),
    (None, [10], {"min_document_tokens": 0, "min_middle_blocks": 0}, ("samkv", None)),  # 0 = never
    (None, [10], {"variant": "reuse"}, ("recompute", "10 document tokens, below min_document_tokens (4096)")),
    (None, [10], {"variant": "recompute"}, ("recompute", None)),
    # many short documents: 32 x 128 tokens (4 blocks of 32, 3 always kept): 0.2 of 4096 tokens is less than
    # their always-kept blocks, so no middle block is left for any of them
    (None, [128] * 32, {}, ("recompute", "the kept budget holds 0 middle blocks for 32 documents, below "
                                         "min_middle_blocks (1) per document")),
    (None, [128] * 32, {"min_middle_blocks": 0}, ("samkv", None)),
    ("samkv", [128] * 32, {}, ("samkv", None)),
    (None, [128] * 32, {"variant": "reuse"}, ("reuse", None)),   # reuse keeps every block: no middle to lose
    (None, [640] * 8, {}, ("samkv", None)),                     # 0.2 * 640 - 96 = 32 tokens: one block each
    # 4 x 1200 tokens: cap 960, always kept 4 x (32 + 32 + 16) = 320 tokens: (960 - 320) // 32 = 20 middle blocks
    (None, [1200] * 4, {"min_middle_blocks": 5}, ("samkv", None)),
    (None, [1200] * 4, {"min_middle_blocks": 6}, ("recompute", "the kept budget holds 20 middle blocks for 4 "
                                                              "documents, below min_middle_blocks (6) per document")),
])
def test_requests_that_name_no_variant_go_to_recompute_when_the_documents_are_short_or_the_budget_keeps_no_middle(
        requested, lengths, cfg_kw, want):
    from sglang_sparse.config import SamKVConfig
    from sglang_sparse.samkv.api import choose_variant

    assert choose_variant(requested, lengths, SamKVConfig(**cfg_kw)) == want


def test_the_front_doors_budget_is_the_one_the_selection_uses():
    """kept_budget (checked at the front door) gives the layouts and middle budget that select_blocks keeps to:
    the max_kept_ratio rule in tokens, with the always-kept blocks trimmed to their share."""
    from flashinfer_ext.samkv.score import anchor_layouts, kept_budget, middle_budget

    for lengths in ([500, 500], [128] * 32, [640] * 8, [1300] * 16, [9000, 9000], [37, 1000, 4096]):
        tokens = sum(lengths)
        cap = int(0.2 * tokens + 1e-9)
        layouts, _ = anchor_layouts(lengths, 32, 1, 2, cap)
        always = sum(len(a) for _, a, _ in layouts)
        always_tokens = sum(min(n, (b + 1) * 32) - b * 32 for n, (_, a, _) in zip(lengths, layouts) for b in a)
        want = middle_budget(sum(nb for nb, _, _ in layouts), len(lengths), always // len(lengths),
                             max(0, cap - always_tokens) // 32)
        plan = kept_budget(lengths, 32, 1, 2, 0.2, 1.0)
        assert plan.layouts == tuple(layouts) and plan.middle_blocks == want and plan.token_cap == cap
        assert plan.docs_with_middle == sum(1 for _, _, m in layouts if m)
    assert kept_budget([500], 32, 1, 2, 1.0).token_cap is None   # ratio 1: SamKV's rule alone
    with pytest.raises(ValueError, match="lengths must be non-empty and positive"):
        kept_budget([], 32, 1, 2)


def test_documents_api_prompt_is_the_stock_inline_prompt_token_for_token(default_model):
    """With the real tokenizer and chat template: documents sent through the API (each tokenised alone, as it
    stands before more text) plus the question give exactly the ids of the stock chat prompt whose user message
    inlines the documents joined by blank lines, then the question. A byte-level BPE tokenises a closing
    ``"\n\n"`` as one token at the end of a string but as two before a word; tokenising ``doc + "\n\n"`` alone
    gave other ids than the inline prompt (and the ``recompute`` baseline answered below stock inline)."""
    from transformers import AutoTokenizer

    from bench import tasks_long as TL
    from sglang_sparse.samkv.api import SEPARATOR, split_user_turn

    tok = AutoTokenizer.from_pretrained(str(default_model))
    for seed in range(3):
        task = TL.make_rag("end", 4, seed, (120, 200))
        system = {"role": "system", "content": task.system}
        inline = tok.apply_chat_template([system, {"role": "user", "content": task.turns[0].user}],
                                         tokenize=True, add_generation_prompt=True)
        question = task.meta["question"]
        prompt = tok.apply_chat_template([system, {"role": "user", "content": question}],
                                         tokenize=True, add_generation_prompt=True)
        inline, prompt = [list(getattr(x, "input_ids", x)) for x in (inline, prompt)]
        cut = split_user_turn(prompt, tok.encode(question, add_special_tokens=False))
        assert cut is not None
        cache = DocumentTokenCache()
        doc_ids = tuple(cache.encode(tok, d + SEPARATOR)[0] for d in task.meta["documents"])
        plan = DocumentPlan(doc_ids, tuple(prompt[cut:]), "", "recompute", prefix_ids=tuple(prompt[:cut]))
        assert plan.input_ids == inline
        # the old encoding (each document with its separator at the end of the string) differs
        assert [i for d in task.meta["documents"] for i in tok.encode(d + SEPARATOR, add_special_tokens=False)] \
            != [i for d in doc_ids for i in d]
