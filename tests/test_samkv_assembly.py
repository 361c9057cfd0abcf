"""The scheduler's SamKV assembly (``sglang_sparse.samkv.assembly._assemble``, the code the server runs in
``Req.init_next_round_input``) on SGLang's real RadixCache / KV pool / allocator, with SmolLM2-135M's real
layer-0 keys: two documents cached alone at positions [0, n) are placed one after the other; the
composite's keys of the second document equal its keys computed at offset ``len(doc 1)`` (bf16, within
two bf16 ulps, with an off-by-one negative control), values are copied bit for bit, the composite is
the tree's entry under the request's namespace, and every KV slot is accounted for (no leak)."""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")

from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey  # noqa: E402

from sglang_sparse.config import SamKVConfig  # noqa: E402
from sglang_sparse.samkv.keys import FILLER_KEY, NS_KEY, PREFIX_KEY, SPANS_KEY, VARIANT_KEY, doc_key_ids  # noqa: E402
from sglang_sparse.samkv.assembly import SamKVRuntime, _assemble  # noqa: E402
from tests.flashinfer_ext.test_rope_shift import _layer0_keys, _max_rel, _rope_theta, smollm2  # noqa: E402,F401

SIZE = 512
FILLER = 0


def _torch_paged_allocator():
    """The pure-torch paged allocator of the test CPU runtime (a CPU pool needs it: SGLang's own launches
    Triton kernels). Installed in the CPU test env; elsewhere (the GPU machine) imported from the repo's
    ``tests/cpu_runtime`` folder - the allocator module only subclasses SGLang's, no platform is activated."""
    try:
        from sglang_sparse_cpu_runtime.allocator import TorchPagedTokenToKVPoolAllocator
    except ModuleNotFoundError:
        import sys
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).parent / "cpu_runtime"))
        from sglang_sparse_cpu_runtime.allocator import TorchPagedTokenToKVPoolAllocator
    return TorchPagedTokenToKVPoolAllocator


def _make(page: int, heads: int, dim: int):
    kv = MHATokenToKVPool(SIZE, page, torch.bfloat16, heads, dim, 1, "cpu", False)
    if page == 1:
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

        alloc = TokenToKVPoolAllocator(SIZE, torch.bfloat16, "cpu", kv, False)
    else:
        TorchPagedTokenToKVPoolAllocator = _torch_paged_allocator()

        alloc = TorchPagedTokenToKVPoolAllocator(SIZE, page, torch.bfloat16, "cpu", kv, False)
    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc,
                             page_size=page)
    return RadixCache(params), kv, alloc


def _cache_document(tree, kv, alloc, ids: list[int], keys: torch.Tensor, ns: str, page: int, seed: int):
    """What the document's own prefill leaves behind: its KV at positions [0, n) under its namespace."""
    key_ids = doc_key_ids(ids, FILLER, page)
    slots = alloc.alloc(len(key_ids))
    g = torch.Generator().manual_seed(seed)
    kv.k_buffer[0][slots[: len(ids)]] = keys
    kv.v_buffer[0][slots] = torch.randn(len(key_ids), *kv.v_buffer[0].shape[1:], generator=g).to(torch.bfloat16)
    res = tree.insert(InsertParams(key=RadixKey(array("q", key_ids), ns), value=slots.to(torch.int64)))
    assert res.prefix_len == 0
    return slots


class _FenceRecorder(SamKVRuntime):
    """The runtime, recording when the assembly fences the device and when it first reads pool KV."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.events: list[str] = []

    def fence(self) -> None:
        self.events.append("fence")

    def shift_keys(self, k, delta):
        self.events.append("kv")
        return super().shift_keys(k, delta)


def test_the_assembly_fences_the_device_once_before_its_first_kv_access(smollm2):
    """Under the overlap scheduler the previous forward may be in flight while the assembly runs: the fence (a
    device-wide synchronise on CUDA) comes before any pool KV is read or written, once per request; a request that
    falls back touches no KV."""
    model, ids = smollm2
    cfg = model.config
    doc_a, doc_b = ids[0, :23].tolist(), ids[0, 5:].tolist()
    tree, kv, alloc = _make(1, cfg.num_key_value_heads, cfg.head_dim)
    ns = "samkv-doc:salt"
    for seed, doc in enumerate((doc_a, doc_b)):
        _cache_document(tree, kv, alloc, doc, _layer0_keys(model, torch.tensor([doc]), 0, torch.bfloat16), ns, 1, seed)
    rt = _FenceRecorder(SamKVConfig(variant="reuse"), _rope_theta(model), cfg.head_dim, None, 1)
    custom = {SPANS_KEY: [0, len(doc_a), len(doc_a), len(doc_b)], NS_KEY: ns, FILLER_KEY: [FILLER, 1],
              VARIANT_KEY: "reuse"}
    req = SimpleNamespace(origin_input_ids=array("q", doc_a + doc_b + [11, 22]), extra_key="samkv:reuse:salt:f",
                          sampling_params=SimpleNamespace(custom_params=custom), rid="f")
    assert _assemble(req, tree, rt, custom)["status"] == "assembled"
    assert rt.events[0] == "fence" and rt.events.count("fence") == 1 and "kv" in rt.events
    rt.events.clear()
    other = dict(custom, **{NS_KEY: "samkv-doc:other"})
    req2 = SimpleNamespace(origin_input_ids=req.origin_input_ids, extra_key="samkv:reuse:other:f",
                           sampling_params=SimpleNamespace(custom_params=other), rid="f2")
    assert _assemble(req2, tree, rt, other)["status"] == "fallback" and rt.events == []


@pytest.mark.parametrize("page", [1, 4])
def test_assembled_keys_equal_keys_at_offset(smollm2, page):
    model, ids = smollm2
    cfg = model.config
    doc_a = ids[0, :23].tolist()
    doc_b = ids[0, 5:].tolist()  # a different document of 30-odd tokens
    question = [11, 22, 33, 44, 55]
    tree, kv, alloc = _make(page, cfg.num_key_value_heads, cfg.head_dim)
    ns = "samkv-doc:salt"
    ka = _layer0_keys(model, torch.tensor([doc_a]), 0, torch.bfloat16)
    kb = _layer0_keys(model, torch.tensor([doc_b]), 0, torch.bfloat16)
    sa = _cache_document(tree, kv, alloc, doc_a, ka, ns, page, 1)
    sb = _cache_document(tree, kv, alloc, doc_b, kb, ns, page, 2)
    rt = SamKVRuntime(SamKVConfig(variant="reuse"), _rope_theta(model), cfg.head_dim, None, 1)
    custom = {SPANS_KEY: [0, len(doc_a), len(doc_a), len(doc_b)], NS_KEY: ns, FILLER_KEY: [FILLER, page],
              VARIANT_KEY: "reuse"}
    all_ids = doc_a + doc_b + question
    req = SimpleNamespace(origin_input_ids=array("q", all_ids), extra_key="samkv:reuse:salt:t",
                          sampling_params=SimpleNamespace(custom_params=custom), rid="t")
    free_before = alloc.available_size()
    result = _assemble(req, tree, rt, custom)
    n_doc = len(doc_a) + len(doc_b)
    aligned = n_doc // page * page
    assert result == {"status": "assembled", "variant": "reuse", "document_tokens": n_doc, "kept_tokens": n_doc,
                      "recomputed_tokens": 0, "composite_cached": False,
                      "kept_ranges": [[0, len(doc_a)], [0, len(doc_b)]], "prefix_tokens": 0}
    assert list(req.origin_input_ids) == all_ids  # reuse keeps every token
    m = tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", all_ids), req.extra_key)))
    assert len(m.device_indices) == aligned
    comp = m.device_indices
    # doc A at offset 0: keys and values copied as they are
    assert torch.equal(kv.k_buffer[0][comp[: len(doc_a)]], ka)
    assert torch.equal(kv.v_buffer[0][comp[: len(doc_a)]], kv.v_buffer[0][sa[: len(doc_a)]])
    # doc B at offset len(doc_a): keys == keys computed there; values bit-identical
    nb = aligned - len(doc_a)
    got = kv.k_buffer[0][comp[len(doc_a):aligned]]
    want = _layer0_keys(model, torch.tensor([doc_b]), len(doc_a), torch.bfloat16)[:nb]
    assert _max_rel(got, want) < 1.5e-2
    off_by_one = _layer0_keys(model, torch.tensor([doc_b]), len(doc_a) + 1, torch.bfloat16)[:nb]
    assert _max_rel(got, off_by_one) > 0.2
    assert torch.equal(kv.v_buffer[0][comp[len(doc_a):aligned]], kv.v_buffer[0][sb[:nb]])
    # the composite's slots belong to the tree now; the documents stay cached and unlocked
    assert alloc.available_size() == free_before - aligned
    assert tree.evictable_size() == SIZE - alloc.available_size() and tree.protected_size() == 0
    # a second identical request finds the composite: no new slots
    req2 = SimpleNamespace(origin_input_ids=array("q", all_ids), extra_key=req.extra_key,
                           sampling_params=req.sampling_params, rid="t2")
    assert _assemble(req2, tree, rt, custom)["composite_cached"] is True
    assert alloc.available_size() == free_before - aligned
    # another salt's namespace holds neither document: served densely
    other = dict(custom, **{NS_KEY: "samkv-doc:other"})
    req3 = SimpleNamespace(origin_input_ids=array("q", all_ids), extra_key="samkv:reuse:other:t",
                           sampling_params=SimpleNamespace(custom_params=other), rid="t3")
    assert _assemble(req3, tree, rt, other) == {"status": "fallback", "reason": "document not cached"}
    assert tree.protected_size() == 0


@pytest.mark.parametrize("positions,ranges", [
    ([], []),
    ([5], [5, 6]),
    ([0, 1, 2, 3], [0, 4]),
    ([0, 1, 2, 16, 17, 40], [0, 3, 16, 18, 40, 41]),
])
def test_kept_ranges_are_flat_half_open_runs_of_the_kept_positions(positions, ranges):
    from sglang_sparse.samkv.assembly import kept_ranges

    assert kept_ranges(positions) == ranges


@pytest.mark.parametrize("page", [1, 4])
def test_documents_cached_behind_a_shared_prefix_assemble_in_the_user_turn(smollm2, page):
    """In-user-turn layout: each document was prefilled as ``P + document`` (P = the template tokens before the
    user's text), so its KV sits behind P's. The composite ``P + doc A + doc B + question`` keeps P's keys as
    cached, doc A's keys where they were (offset |P|) and doc B's keys re-rotated to |P| + len(doc A)."""
    model, ids = smollm2
    cfg = model.config
    prefix = ids[0, 30:39].tolist()   # stands for "<|im_start|>system ... <|im_start|>user\n"
    doc_a = ids[0, :13].tolist()
    doc_b = ids[0, 5:26].tolist()
    question = [11, 22, 33, 44, 55]
    lp = len(prefix)
    tree, kv, alloc = _make(page, cfg.num_key_value_heads, cfg.head_dim)
    ns = "samkv-doc:secret:salt"
    pa = _layer0_keys(model, torch.tensor([prefix + doc_a]), 0, torch.bfloat16)
    pb = _layer0_keys(model, torch.tensor([prefix + doc_b]), 0, torch.bfloat16)
    sa = _cache_document(tree, kv, alloc, prefix + doc_a, pa, ns, page, 1)
    # P + doc B shares P's radix node: only doc B's part needs new slots (insert the whole key like a prefill)
    key_b = doc_key_ids(prefix + doc_b, FILLER, page)
    slots_b = alloc.alloc(len(key_b))
    kv.k_buffer[0][slots_b[: lp + len(doc_b)]] = pb
    res = tree.insert(InsertParams(key=RadixKey(array("q", key_b), ns), value=slots_b.to(torch.int64)))
    alloc.free(slots_b[:res.prefix_len])
    rt = SamKVRuntime(SamKVConfig(variant="reuse"), _rope_theta(model), cfg.head_dim, None, 1)
    custom = {SPANS_KEY: [lp, len(doc_a), lp + len(doc_a), len(doc_b)], NS_KEY: ns, FILLER_KEY: [FILLER, page],
              VARIANT_KEY: "reuse", PREFIX_KEY: lp}
    all_ids = prefix + doc_a + doc_b + question
    req = SimpleNamespace(origin_input_ids=array("q", all_ids), extra_key="samkv:secret:reuse:salt:t",
                          sampling_params=SimpleNamespace(custom_params=custom), rid="t")
    result = _assemble(req, tree, rt, custom)
    assert result["status"] == "assembled" and result["prefix_tokens"] == lp
    assert result["document_tokens"] == len(doc_a) + len(doc_b) == result["kept_tokens"]
    n = lp + len(doc_a) + len(doc_b)
    aligned = n // page * page
    comp = tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", all_ids), req.extra_key))).device_indices
    assert len(comp) == aligned
    # P and doc A: exactly the cached keys (delta 0)
    assert torch.equal(kv.k_buffer[0][comp[:lp + len(doc_a)]], pa)
    assert torch.equal(kv.v_buffer[0][comp[:lp + len(doc_a)]], kv.v_buffer[0][sa[:lp + len(doc_a)]])
    # doc B: its keys as if computed at lp + len(doc A)
    nb = aligned - lp - len(doc_a)
    got = kv.k_buffer[0][comp[lp + len(doc_a):aligned]]
    want = _layer0_keys(model, torch.tensor([doc_b]), lp + len(doc_a), torch.bfloat16)[:nb]
    assert _max_rel(got, want) < 1.5e-2
    wrong = _layer0_keys(model, torch.tensor([doc_b]), len(doc_a), torch.bfloat16)[:nb]  # P's offset forgotten
    assert _max_rel(got, wrong) > 0.2
    # a request whose prefix differs (another system prompt) finds no cached document: dense fallback
    other_ids = [7] + prefix[1:] + doc_a + doc_b + question
    req2 = SimpleNamespace(origin_input_ids=array("q", other_ids), extra_key="samkv:secret:reuse:salt:u",
                           sampling_params=SimpleNamespace(custom_params=custom), rid="u")
    assert _assemble(req2, tree, rt, custom) == {"status": "fallback", "reason": "document not cached"}
    assert tree.protected_size() == 0
