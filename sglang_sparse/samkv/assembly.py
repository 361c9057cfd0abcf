"""``--sparse samkv`` in the scheduler: the composite context of a documents request, built from the
documents' cached KV and handed to SGLang as the request's matched prefix.

Hook: AFTER ``Req.init_next_round_input`` (no-op unless the request carries the document spans
:mod:`sglang_sparse.samkv.api` puts in ``custom_params``, which only happens under ``--sparse samkv``;
runs once per request). Steps, all inside the scheduler thread:

1. Each document's KV: ``match_prefix`` of its prefill ids (``samkv.keys.doc_key_ids``) in the
   document namespace; its radix node is locked while it is read. A document not (fully) cached
   -> the request is served densely (``fallback``; the prompt is unchanged, nothing is reused).
2. Selection of the kept tokens of each document (``variant`` ``reuse`` / ``cacheblend``: all;
   ``samkv``: initial + local blocks + the blocks :mod:`sglang_sparse.samkv.select` keeps). Dropped blocks leave the
   context: the request's ``origin_input_ids`` become ``kept document tokens + prompt`` and the
   kept tokens get consecutive positions (so ``prompt_tokens`` in ``usage`` counts the kept
   context; the KV kept ratio is honest: unkept KV is neither copied nor attended).
3. Fresh KV slots for the page-aligned composite (evicting through the tree if needed); per layer,
   values copied and keys re-rotated by ``new position - position in the document``
   (:func:`flashinfer_ext.samkv.rope_shift.rope_shift`; its fp32 torch reference on CPU). Variants ``samkv``
   and ``cacheblend`` then recompute ``recompute_ratio`` of the kept tokens over the composite
   (:mod:`sglang_sparse.samkv.recompute`, Eq. 4 overwrite / fusion).
4. The composite is inserted into the radix tree under the request's composite namespace (its
   ``extra_key``; duplicates freed as SGLang's own inserts do), the documents unlocked, and the stock
   prefix match re-run: the composite is now the request's prefix, so only the prompt (and the
   sub-page tail of the composite) is extended. The tree owns the composite slots from here on
   (refcounted, LRU-evicted), so SGLang's idle KV-leak check stays silent.

The per-request result (status, kept and recomputed tokens) is kept on the ``Req`` as ``samkv_result``
and reaches the reply's ``meta_info["samkv"]`` through ``req.customized_info``. Shapes: pool
keys/values per layer ``[slots, kv_heads, head_dim]`` (post-RoPE keys).
"""

from __future__ import annotations

import logging
import time
from array import array

import torch

from sglang_sparse.samkv.keys import FILLER_KEY, NS_KEY, PREFIX_KEY, SPANS_KEY, VARIANT_KEY, doc_key_ids

logger = logging.getLogger("sglang_sparse")

META_KEY = "samkv"  # meta_info key of the scheduler's per-request assembly result


def kept_ranges(positions: list[int]) -> list[int]:
    """Sorted kept in-document token positions as flat half-open ranges ``[start_0, end_0, start_1, end_1, ...]``
    (what ``metadata["sparse"]["kept_ranges"]`` reports per document: which parts of it the model saw)."""
    out: list[int] = []
    for p in positions:
        if out and out[-1] == p:
            out[-1] = p + 1
        else:
            out += [p, p + 1]
    return out


def kept_from_meta(meta: dict, document_tokens: int, prompt_tokens: int) -> int:
    """Document tokens kept in the context, from a reply's ``prompt_tokens`` (the scheduler rewrote
    the prompt to ``kept document tokens + prompt``)."""
    return max(0, min(document_tokens, int(meta.get("prompt_tokens", 0)) - prompt_tokens))


class SamKVRuntime:
    """Scheduler-side context of ``--sparse samkv`` (attached to the tree cache at scheduler start).

    config: :class:`~sglang_sparse.config.SamKVConfig`; rope_theta / rotary_dim: the model's RoPE
    (NeoX layout, frequency-only); model: the model module (for the selection's side forward);
    num_layers: KV layers.
    """

    def __init__(self, config, rope_theta: float, rotary_dim: int, model, num_layers: int, metrics=None,
                 inv_freq: torch.Tensor | None = None):
        from sglang_sparse.samkv.stats import SamKVStats

        self.config = config
        self.rope_theta = float(rope_theta)
        self.rotary_dim = int(rotary_dim)
        self.inv_freq = inv_freq  # fp32 [rotary_dim // 2] of a frequency-scaled RoPE (YaRN); None: plain
        self.model = model
        self.num_layers = int(num_layers)
        self.stats = SamKVStats()
        self.metrics = metrics  # SamKVMetrics under --enable-metrics
        self._times: dict[str, float] | None = None
        self._last = 0.0
        self._paths: dict[str, str] = {}
        self.side_graphs = self._side_graphs(config, model, self.num_layers)

    def _side_graphs(self, config, model, num_layers: int):
        """The padded / CUDA-graph side forward (:mod:`sglang_sparse.samkv.graph`) per ``config.side_graphs``:
        ``pad`` anywhere, ``auto`` on CUDA only; None = the eager path."""
        mode = getattr(config, "side_graphs", "off")
        if model is None or mode == "off":
            return None
        cuda = next(model.parameters()).device.type == "cuda"
        if mode == "auto" and not cuda:
            return None
        from sglang_sparse.samkv.graph import SideGraphs

        q_from = max(0, num_layers - config.stable_layers)
        if config.selection == "mass":
            q_from = min(q_from, config.mass_layer_range(num_layers)[0])
        return SideGraphs(self, q_from, config.side_graph_max_rows, config.side_graph_max_context,
                          capture=mode == "auto")

    def note_path(self, kind: str, path: str) -> None:
        """Record which side-forward path (``graph`` / ``pad`` / ``eager``) served ``kind`` in this request."""
        self._paths[kind] = path

    def take_paths(self) -> dict[str, str]:
        out, self._paths = self._paths, {}
        return out

    def record(self, result: dict) -> None:
        """Count one request's assembly result (server statistics and metrics)."""
        self.stats.record(result)
        if self.metrics is not None:
            self.metrics.record(result)

    def timing_start(self) -> None:
        """Start the per-request phase clock (:meth:`tick`); off until called, so direct callers pay nothing."""
        self._times, self._last = {}, time.perf_counter()

    def tick(self, name: str) -> None:
        """Close phase ``name`` (ms since the previous tick). Synchronises CUDA first so each phase owns its
        kernels: a handful of syncs per request, the price of a breakdown that means something."""
        if self._times is None:
            return
        self.fence()
        now = time.perf_counter()
        self._times[name] = round(self._times.get(name, 0.0) + 1000.0 * (now - self._last), 3)
        self._last = now

    def timing_done(self) -> dict[str, float]:
        out, self._times = dict(self._times or {}), None
        out["total"] = round(sum(out.values()), 3)
        return out

    @staticmethod
    def fence() -> None:
        """Wait for every stream of the device. Under SGLang's overlap scheduler the assembly runs in
        ``get_next_batch_to_run`` while the previous forward may still be in flight; KV slots that the assembly
        allocates may have been freed by requests that forward still reads or writes. Called once per request,
        before the assembly's first KV read or write."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    def shift_keys(self, k: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Keys ``[n, kv_heads, head_dim]`` re-rotated by per-token ``delta`` ``[n]`` (int64)."""
        from flashinfer_ext.samkv.rope_shift import rope_shift, rope_shift_reference

        fn = rope_shift if k.is_cuda else rope_shift_reference
        if self.inv_freq is not None and self.inv_freq.device != k.device:  # moved once, not per layer
            self.inv_freq = self.inv_freq.to(k.device)
        return fn(k, delta, rope_theta=self.rope_theta, rotary_dim=self.rotary_dim, inv_freq=self.inv_freq)


def scheduler_init_hook(result, scheduler, *args, **kwargs):
    """AFTER ``Scheduler.__init__``: attach a :class:`SamKVRuntime` to the tree cache under samkv."""
    from sglang_sparse.modes import sparse_context_of

    ctx = sparse_context_of(scheduler.server_args)
    if ctx.mode != "samkv":
        return result
    runner = scheduler.tp_worker.model_runner
    model = runner.model
    rope = _rotary(model)
    inv_freq = rope_inv_freq_of(rope)
    metrics = None
    if scheduler.server_args.enable_metrics:
        from sglang_sparse.samkv.stats import SamKVMetrics

        metrics = SamKVMetrics()
    scheduler.tree_cache.samkv_runtime = SamKVRuntime(
        ctx.config, rope.base, rope.rotary_dim, model, runner.model_config.num_hidden_layers, metrics=metrics,
        inv_freq=inv_freq)
    return result


# RoPE classes whose reused keys can be re-rotated exactly: NeoX-style rotations by ``pos * inv_freq``.
# YaRN only changes ``inv_freq`` and multiplies cos/sin by a constant ``mscale``; a rotation keeps that
# factor, so re-rotating a cached key by ``delta`` with YaRN's own ``inv_freq`` (no second mscale) gives
# the key SGLang computes at the new position.
_SHIFTABLE_ROPES = ("RotaryEmbedding", "YaRNScalingRotaryEmbedding")


def rope_inv_freq_of(rope) -> torch.Tensor | None:
    """``inv_freq`` fp32 for :func:`flashinfer_ext.samkv.rope_shift.rope_shift` of the model's RoPE module:
    None for plain RoPE (recomputed from ``rope_theta``), YaRN's scaled frequencies for YaRN; raises for
    any other RoPE (re-rotation would not be exact)."""
    name = type(rope).__name__
    if rope is None or not getattr(rope, "is_neox_style", True) or name not in _SHIFTABLE_ROPES:
        raise RuntimeError(f"sglang-sparse samkv: the model's RoPE ({name}) is not NeoX RoPE or YaRN; "
                           "re-rotating reused keys is only exact for those")
    if name == "RotaryEmbedding":
        return None
    return rope._compute_inv_freq(rope.scaling_factor).to(torch.float32).cpu()


def _rotary(model):
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers:
        return None
    return getattr(getattr(layers[0], "self_attn", None), "rotary_emb", None)


def init_round_hook(result, req, *args, **kwargs):
    """AFTER ``Req.init_next_round_input``: assemble the composite context once per documents request."""
    custom = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    if not isinstance(custom, dict) or SPANS_KEY not in custom or getattr(req, "samkv_result", None) is not None:
        return result
    tree_cache = kwargs.get("tree_cache", args[0] if args else None)
    rt = getattr(tree_cache, "samkv_runtime", None)
    if rt is None:
        return result
    req.samkv_result = {"status": "pending"}
    rt.timing_start()
    wall0 = time.time()
    try:
        req.samkv_result = _assemble(req, tree_cache, rt, custom)
    except Exception as e:  # never take the scheduler down: serve the request densely
        logger.exception("sglang-sparse samkv: assembly failed for %s; serving it densely", req.rid)
        req.samkv_result = {"status": "error", "reason": type(e).__name__}
        rt.take_paths()
        rt.timing_done()
        rt.record(req.samkv_result)
        return result
    # where the scheduler's time went (ms per phase, CUDA-synchronised): metadata["sparse"]["scheduler_ms"]
    req.samkv_result["timing_ms"] = rt.timing_done()
    # wall-clock span of the assembly (epoch seconds): a client on the same host splits its latency into before /
    # assembly / after (bench/samkv_bench.py)
    req.samkv_result["wall_s"] = [wall0, time.time()]
    paths = rt.take_paths()
    if paths:  # which side-forward path ran (graph / pad / eager, sglang_sparse.samkv.graph)
        req.samkv_result["side_forward"] = paths
    rt.record(req.samkv_result)
    reason = req.samkv_result.get("reason")
    logger.info("sglang-sparse samkv: %s %s%s timing_ms=%s", req.rid, req.samkv_result.get("status"),
                f" ({reason})" if reason else "", req.samkv_result["timing_ms"])
    # to the response: SGLang carries req.customized_info[key] (one entry per output token, sliced from
    # the first) into meta_info[key]; the first output token brings this result along
    info = getattr(req, "customized_info", None) or {}
    req.customized_info = {**info, META_KEY: [dict(req.samkv_result)]}
    if req.samkv_result.get("status") == "assembled":
        req.init_next_round_input(*args, **kwargs)  # stock match again: finds the composite
    return result


def _spans(custom, n_ids: int, prefix: int = 0) -> list[tuple[int, int]]:
    flat = custom[SPANS_KEY]
    if not isinstance(flat, list) or len(flat) % 2 or not flat:
        raise ValueError("bad samkv spans")
    spans = [(int(flat[i]), int(flat[i + 1])) for i in range(0, len(flat), 2)]
    pos = prefix
    for s, n in spans:
        if s != pos or n <= 0:
            raise ValueError(f"samkv spans must tile the documents from {prefix}")
        pos += n
    if pos >= n_ids:
        raise ValueError("samkv spans leave no prompt")
    return spans


def _assemble(req, tree_cache, rt, custom) -> dict:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    variant = custom.get(VARIANT_KEY)
    if variant == "recompute":
        return {"status": "recompute"}
    ids = [int(x) for x in req.origin_input_ids]
    lp = int(custom.get(PREFIX_KEY, 0) or 0)  # the shared template prefix P before the documents
    spans = _spans(custom, len(ids), lp)
    ns = str(custom[NS_KEY])
    filler, page = (int(x) for x in custom[FILLER_KEY])
    page = max(1, int(getattr(tree_cache, "page_size", 1) or 1))
    n_doc = spans[-1][0] + spans[-1][1]  # end of the documents in ids

    locked, srcs, p_src = [], [], None
    try:
        for s, n in spans:  # each document was prefilled as P + document: its KV sits behind P's
            key = RadixKey(array("q", doc_key_ids(ids[:lp] + ids[s:s + n], filler, page)), ns)
            m = tree_cache.match_prefix(MatchPrefixParams(key=key))
            if len(m.device_indices) < lp + n:
                return {"status": "fallback", "reason": "document not cached"}
            tree_cache.inc_lock_ref(m.last_device_node)
            locked.append(m.last_device_node)
            srcs.append(m.device_indices[lp:lp + n])
            if p_src is None:
                p_src = m.device_indices[:lp]
        rt.fence()  # the overlap scheduler's in-flight forward ends before any KV access below
        _tick(rt, "match_documents")
        keep, scores = _select(rt, spans, srcs, ids, variant, tree_cache, lp)
        _tick(rt, "select")
        # kept tokens: their index into all documents' slots and their RoPE delta (new position - position in
        # the document), built on the host, moved in one transfer when needed
        # P's tokens: as cached (index 0..lp-1 of the gathered slots, delta 0); document tokens: gathered after
        # P, cached at lp + p, placed at lp + base + i
        new_doc_ids, gidx, delta_list = [], list(range(lp)), [0] * lp
        for (s, n), kp in zip(spans, keep):
            base = len(new_doc_ids)
            new_doc_ids.extend(ids[s + p] for p in kp)
            gidx.extend(lp + (s - lp) + p for p in kp)
            delta_list.extend(base + i - p for i, p in enumerate(kp))
        n_kept = len(new_doc_ids)
        new_ids = ids[:lp] + new_doc_ids + ids[n_doc:]
        aligned = ((lp + n_kept) // page) * page
        result = {"status": "assembled", "variant": variant, "document_tokens": n_doc - lp, "kept_tokens": n_kept,
                  "recomputed_tokens": 0, "kept_ranges": [kept_ranges(kp) for kp in keep], "prefix_tokens": lp}
        if aligned <= lp:
            result["status"] = "too_short"
            return result
        key = RadixKey(array("q", new_ids[:aligned]), req.extra_key)
        have = len(tree_cache.match_prefix(MatchPrefixParams(key=key)).device_indices)
        if have < aligned:
            alloc = tree_cache.token_to_kv_pool_allocator
            dst = alloc.alloc(aligned)
            if dst is None:
                tree_cache.evict(EvictParams(num_tokens=aligned))
                dst = alloc.alloc(aligned)
            if dst is None:
                return {"status": "fallback", "reason": "no free KV slots for the composite"}
            src_all = torch.cat([p_src] + srcs) if lp else (srcs[0] if len(srcs) == 1 else torch.cat(srcs))
            host = torch.tensor(gidx[:aligned] + delta_list[:aligned], dtype=torch.int64).to(src_all.device)
            g_t, delta = host.split(aligned)
            src = src_all.index_select(0, g_t)
            pool = alloc.get_kvcache()
            slots = pool.get_key_buffer(0).shape[0]
            if dst.numel() != aligned or int(src.min()) < 0 or int(torch.maximum(src.max(), dst.max())) >= slots:
                alloc.free(dst)  # one host check per request (the assembly synchronises per phase anyway)
                return {"status": "fallback", "reason": "KV slot indices out of the pool's range"}
            _tick(rt, "alloc")
            for layer in range(rt.num_layers):
                kbuf, vbuf = pool.get_key_buffer(layer), pool.get_value_buffer(layer)
                kbuf[dst] = rt.shift_keys(kbuf[src], delta).to(kbuf.dtype)
                vbuf[dst] = vbuf[src]
            _tick(rt, "copy_rope_shift")
            if scores is not None and rt.config.recompute_ratio > 0:
                from sglang_sparse.samkv.recompute import recompute, recompute_set

                r_idx = [lp + j for j in recompute_set(keep, scores, rt.config.recompute_ratio, aligned - lp)]
                recompute(rt, pool, dst, new_ids, r_idx, rt.config.fuse)
                result["recomputed_tokens"] = len(r_idx)
                _tick(rt, "recompute")
            res = tree_cache.insert(InsertParams(key=key, value=dst.to(torch.int64)))
            if res.prefix_len > 0:
                alloc.free(dst[:res.prefix_len])
            _tick(rt, "insert")
        result["composite_cached"] = have >= aligned
        if new_ids != ids:
            req.origin_input_ids = array("q", new_ids)
            req.origin_input_ids_unpadded = req.origin_input_ids
            req.full_untruncated_fill_ids = array("q")
        return result
    finally:
        for node in locked:
            tree_cache.dec_lock_ref(node)


def _tick(rt, name: str) -> None:
    tick = getattr(rt, "tick", None)
    if tick is not None:
        tick(name)


def _select(rt, spans, srcs, ids, variant, tree_cache, prefix: int = 0):
    """Kept in-document positions of each document (sorted) and the token scores that pick the recompute
    set (None for ``reuse``: nothing is recomputed). ``prefix``: the documents' KV was cached at positions
    ``prefix + p``."""
    if variant == "reuse":
        return [list(range(n)) for _, n in spans], None
    from sglang_sparse.samkv.select import select_blocks

    return select_blocks(rt, spans, srcs, ids, tree_cache, keep_all=variant == "cacheblend", cached_at=prefix)
