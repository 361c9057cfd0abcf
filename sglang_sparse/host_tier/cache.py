"""Host tier for radix nodes: nodes evicted from the GPU move to pinned host memory and
come back on a prefix hit instead of being recomputed.

How it plugs in: a radix-cache backend registered with SGLang (``mem_cache/registry.py``,
:data:`BACKEND_NAME`), selected automatically (``--radix-cache-backend``) when the mode's config has
``host_tier_gb > 0``. :class:`HostTierRadixCache` subclasses the stock ``RadixCache`` and overrides
only what the host tier changes; the stock tree, lock refs, protected/evictable sizes and allocator stay
as they are, so SGLang's idle KV-leak check sees the stock accounting (hooks other modes put on
``RadixCache`` methods still run: the overrides call ``super()``):

  * ``evict``: the stock eviction; every leaf it deletes (``_delete_leaf``) is queued, and after the
    stock loop (before any freed slot can be reallocated) their KV pages of all layers are packed on the
    device (:func:`flashinfer_ext.host_tier.kv_units.pack_pages`) and saved CPU-assisted into host blocks
    (``HostSave``: one contiguous D2H copy + thread scatter). The node leaves the GPU tree; its KV is a
    :class:`radix_sparse.host_nodes.HostNode` entry addressed by its token path. Nodes already on the host
    (a node reloaded earlier: entries are immutable) are not saved again.
  * ``match_prefix`` (requests only, ``params.req`` set): the stock match, then the host entries that
    continue it give ``host_hit_length`` (SGLang's HiCache field): the scheduler's ``PrefillAdder``
    budgets the request with it and, under its admission lock on the matched node, calls
    ``init_load_back``.
  * ``init_load_back``: allocates GPU slots through the stock allocator (evicting unlocked leaves if
    needed, as HiCache does), gathers the entries' units through the shared GPU unit cache
    (``HostBlockPool.acquire`` + ``HostTierIO``: the fused UVA gather on CUDA; on CPU the same
    ``HostGather`` object on its ``torch_staging`` path, because Triton has no CPU target outside the
    interpreter), unpacks them into the new pages and inserts the tokens into the tree (stock
    ``insert``: the nodes are ordinary evictable nodes again). SGLang then counts them as cached tokens.

Sparse metadata: PSA's CPU runner rebuilds block metadata from the KV at every decode step (nothing to
carry); PSA's CUDA runner keeps per-page metadata, which is **recomputed from the reloaded keys** by a
load listener (``PsaCudaRunner.rebuild_page_meta``) instead of being carried through the host.
LoopServe's line sets travel with the node (:mod:`radix_sparse.host_lines`): ``_delete_leaf`` takes the
evicted leaf's entries out of the line store (all turns stored on it) before :mod:`sglang_sparse.loopserve.radix`'s hook would
free them, and ``save`` keeps them as CPU tensors beside the node's host entry (a ``HostLineStore`` bounded by
``line_store_mb``, LRU; they are dropped with the entry). A node whose KV is already on the host replaces the
lines of the entry it matches exactly (or of the entries it spans, split at their boundaries). After
``init_load_back``'s ``insert`` the lines of the loaded entries are attached to the new node holding the
reloaded tokens (positions unchanged; a load that stops inside an entry keeps that entry's part before the
stop, by the radix split rule); a node whose range is not the loaded range gets none (counted as
``line_mismatches``). Lines that cannot travel (node not saved, budget) are dropped and counted
(``line_turns_dropped``).

Everything here runs in the scheduler thread while batches are planned, never per layer.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InitLoadBackParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

from radix_sparse.host_lines import HostLineConfig, HostLineStore, partition_lines, restore_lines
from radix_sparse.host_nodes import HostNodeStore
from radix_sparse.host_pool import HostBlockPool, HostTierConfig, KVShape
from sglang_sparse.loopserve.radix import lines_of
from sglang_sparse.loopserve.radix import node_depth as _depth

logger = logging.getLogger("sglang_sparse")

BACKEND_NAME = "sglang_sparse_host_tier"
_MAX_TRANSFER_MB = 64  # device staging of one save / load chunk


def host_tier_enabled(config) -> bool:
    return float(getattr(config, "host_tier_gb", 0.0) or 0.0) > 0.0


def tier_config(config, page_size: int) -> HostTierConfig:
    """The :class:`HostTierConfig` of a mode config with ``host_tier_gb > 0``."""
    return HostTierConfig(host_tier_gb=float(config.host_tier_gb), gpu_cache_mb=float(config.gpu_cache_mb),
                          page_size=int(page_size), working_set_window=int(config.working_set_window))


def apply_server_args(args, ctx) -> None:
    """``SparseServerArgs.__post_init__``: select the host-tier radix cache when ``host_tier_gb > 0``."""
    from sglang_sparse.config import SparseConfigError

    if not host_tier_enabled(ctx.config):
        return
    why = None
    if getattr(args, "disable_radix_cache", False):
        why = "--disable-radix-cache (the host tier keeps evicted radix nodes)"
    elif getattr(args, "enable_hierarchical_cache", False):
        why = "--enable-hierarchical-cache (SGLang's own host tier)"
    elif getattr(args, "radix_cache_backend", None) not in (None, BACKEND_NAME):
        why = f"--radix-cache-backend {args.radix_cache_backend}"
    if why:
        raise SparseConfigError(f"--sparse-config: host_tier_gb={ctx.config.host_tier_gb} cannot be used with {why}")
    if args.radix_cache_backend != BACKEND_NAME:
        logger.info("sglang-sparse: host tier on (%.3g GiB): --radix-cache-backend %s", ctx.config.host_tier_gb,
                    BACKEND_NAME)
        args.radix_cache_backend = BACKEND_NAME


def _model_kv_shape(args):
    """``(layers, KV heads per rank, head_dim, bytes per element)`` of the served model's KV, read from its HF
    config in the main process (None when the config cannot be read: the scheduler's own check then applies)."""
    try:
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(args.model_path, trust_remote_code=bool(getattr(args, "trust_remote_code",
                                                                                        False)))
        text = getattr(hf, "text_config", None) or hf
        layers = int(text.num_hidden_layers)
        heads = int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads)
        head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
    except Exception:  # noqa: BLE001 - no readable config here: leave the check to the scheduler
        return None
    heads = max(1, heads // max(1, int(getattr(args, "tp_size", 1) or 1)))
    name = str(getattr(args, "kv_cache_dtype", "auto") or "auto")
    if name == "auto":
        name = str(getattr(args, "dtype", "auto") or "auto")
    if name == "auto":
        name = str(getattr(text, "torch_dtype", None) or getattr(text, "dtype", None) or "bfloat16")
    size = 4 if "32" in name or name in ("float", "torch.float") else 1 if "fp8" in name or "8" in name else 2
    return layers, heads, head_dim, size


def check_tier_sizes(args, ctx) -> None:
    """After SGLang resolved the page size: ``host_tier_gb`` and ``gpu_cache_mb`` must each hold one KV page of
    all layers of the model, else the tier cannot be built; refused here with the smallest useful values
    (:class:`~sglang_sparse.config.SparseConfigError`, exit 2) instead of failing in the scheduler."""
    from sglang_sparse.config import SparseConfigError

    if not host_tier_enabled(ctx.config):
        return
    shape = _model_kv_shape(args)
    if shape is None:
        return
    layers, heads, head_dim, size = shape
    page = max(1, int(getattr(args, "page_size", None) or 1))
    unit = 2 * page * head_dim * size
    block = layers * heads * unit
    what = (f"{layers} layers x {heads} KV heads x page {page} x head_dim {head_dim} x 2 (K and V) x {size} "
            "bytes")
    gb = float(ctx.config.host_tier_gb)
    if int(gb * (1 << 30)) < block:
        raise SparseConfigError(
            f"--sparse-config: field 'host_tier_gb' of mode '{ctx.mode}' = {gb:g} holds no KV block of this model "
            f"({block} bytes: {what}); the smallest useful value is {_round_up(block / (1 << 30))} "
            "(one block), or 0 for no host tier")
    mb = float(ctx.config.gpu_cache_mb)
    if int(mb * (1 << 20)) // unit < layers * heads:  # reloads gather one KV page of all layers at least
        raise SparseConfigError(
            f"--sparse-config: field 'gpu_cache_mb' of mode '{ctx.mode}' = {mb:g} holds less than one KV page of "
            f"all layers of this model ({block} bytes: {what}); the smallest useful value is "
            f"{_round_up(block / (1 << 20))}")


def _round_up(x: float) -> str:
    """``x`` with 3 significant digits, rounded up (so the printed value is itself enough)."""
    import math

    e = math.floor(math.log10(x)) - 2
    return f"{math.ceil(x / 10 ** e) * 10 ** e:.3g}"


def register_backend() -> None:
    """Register :func:`make_tree_cache` under :data:`BACKEND_NAME` (idempotent)."""
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend

    if get_radix_cache_factory(BACKEND_NAME) is None:
        register_radix_cache_backend(BACKEND_NAME, make_tree_cache)


def make_tree_cache(build):
    """Radix-cache factory (``TreeCacheBuildContext`` -> :class:`HostTierRadixCache`)."""
    from sglang_sparse.modes import sparse_context_of

    ctx = sparse_context_of(build.server_args)
    if not host_tier_enabled(ctx.config):
        raise RuntimeError(f"sglang-sparse: --radix-cache-backend {BACKEND_NAME} needs host_tier_gb > 0 in "
                           f"--sparse-config (mode {ctx.mode})")
    for flag in ("is_hybrid_swa", "is_hybrid_ssm", "is_dsa", "enable_hierarchical_cache", "disable_radix_cache"):
        if getattr(build, flag, False):
            raise RuntimeError(f"sglang-sparse host tier: not supported with {flag} (plain MHA radix cache only)")
    metrics = HostTierMetrics() if build.server_args.enable_metrics else None
    tier = HostTier(tier_config(ctx.config, build.params.page_size), build.params.token_to_kv_pool_allocator,
                    metrics, line_budget=int(getattr(ctx.config, "line_store_mb", 0) or 0) << 20)
    cache = HostTierRadixCache(build.params, tier)
    runner = getattr(getattr(getattr(build.tp_worker, "model_runner", None), "attn_backend", None), "_psa_runner",
                     None)
    if runner is not None and getattr(runner, "page_is_block", False):
        tier.load_listeners.append(runner.rebuild_page_meta)
    logger.info("sglang-sparse host tier: %d host blocks (%.1f MiB, page %d), GPU unit cache %d units, "
                "gather path %s", tier.pool.num_blocks, tier.pool.num_blocks * tier.pool.block_bytes / 2**20,
                tier.page_size, tier.pool.cache.capacity, tier.io.gather.path)
    return cache


# ------------------------------------------------------------------------------------------- stats
@dataclass
class HostTierServerStats:
    """Counters since start-up (``/server_info`` -> ``internal_states[0].sparse.host_tier``)."""

    saved_nodes: int = 0
    saved_tokens: int = 0
    save_skipped_nodes: int = 0     # evicted nodes whose KV was already on the host
    unsaved_nodes: int = 0          # evicted nodes that did not fit the host tier (recomputed on reuse)
    loads: int = 0                  # init_load_back calls that loaded tokens
    loaded_nodes: int = 0
    loaded_tokens: int = 0
    failed_loads: int = 0           # no GPU memory even after eviction: the tokens are recomputed
    line_turns_saved: int = 0       # LoopServe turn entries moved to the host with their node
    line_turns_restored: int = 0    # turn entries attached again to a reloaded node
    line_turns_dropped: int = 0     # turn entries lost on the way (node not saved, budget, boundary mismatch)
    line_mismatches: int = 0        # loads whose inserted node did not cover exactly the loaded range
    gathered_bytes: int = 0
    gather_seconds: float = 0.0     # load wall time (gather + unpack), completed loads


class HostTierMetrics:
    """Prometheus metrics of the scheduler process (``/metrics`` with ``--enable-metrics``)."""

    def __init__(self, registry=None):
        from sglang_sparse.stats import MetricSet

        m = MetricSet("host_tier", registry)
        c = m.counter
        g = lambda name, doc: m.gauge(name, doc, multiprocess_mode="mostrecent")  # noqa: E731
        self.saved_nodes = c("saved_nodes", "radix nodes evicted from the GPU whose KV was saved to the host")
        self.saved_tokens = c("saved_tokens", "tokens of those nodes")
        self.loads = c("loads", "prefix hits served (partly) from the host tier")
        self.loaded_tokens = c("loaded_tokens", "tokens loaded back from the host instead of recomputed")
        self.failed_loads = c("failed_loads", "host hits that could not be loaded (no GPU memory): recomputed")
        self.host_bytes = g("host_bytes", "host bytes held by host-resident radix nodes")
        self.host_nodes = g("host_nodes", "host-resident radix nodes")
        self.host_line_bytes = g("host_line_bytes", "bytes of LoopServe line sets kept with host-resident nodes")
        self.restored_line_turns = c("restored_line_turns", "LoopServe turn line sets attached again to reloaded "
                                                            "radix nodes")
        self.hit_rate = g("gpu_cache_hit_rate", "hit rate of the GPU unit cache over reloaded units")
        self.gather_gbps = g("gathered_gbps", "reload bandwidth: gathered bytes / load time (gather + unpack), GB/s")


# ------------------------------------------------------------------------------------------- tier
class HostTier:
    """Host pool + node store + transfer objects for the KV pool behind ``allocator``.

    KV pool contract: ``k_buffer`` / ``v_buffer`` lists of ``[slots, kv_heads, head_dim]`` tensors (SGLang's
    default MHA layout), one dtype (bf16/fp16/fp32, no quantised storage), ``v_head_dim == head_dim``.
    Device memory: the GPU unit cache (``gpu_cache_mb``) + one pack buffer (<= 64 MiB).
    """

    def __init__(self, cfg: HostTierConfig, allocator, metrics: HostTierMetrics | None = None,
                 line_budget: int = 0) -> None:
        """``line_budget``: bytes of LoopServe line sets kept with host entries (0: none)."""
        from flashinfer_ext.host_tier.host_transfer import HostTierIO

        kv = allocator.get_kvcache()
        k0 = kv.k_buffer[0] if hasattr(kv, "k_buffer") else None
        if k0 is None or k0.dim() != 3 or getattr(kv, "store_dtype", k0.dtype) != getattr(kv, "dtype", k0.dtype) \
                or kv.v_buffer[0].shape != k0.shape:
            raise RuntimeError(f"sglang-sparse host tier: KV pool {type(kv).__name__} is not the plain MHA "
                               "[slots, kv_heads, head_dim] layout with unquantised K and V of one shape")
        p = cfg.page_size
        n = k0.shape[0] // p * p
        self.k_bufs = [b[:n] for b in kv.k_buffer]
        self.v_bufs = [b[:n] for b in kv.v_buffer]
        self.page_size, self.device = p, k0.device
        self.shape = KVShape(len(self.k_bufs), k0.shape[1], k0.shape[2], k0.dtype)
        self.pool = HostBlockPool(cfg, self.shape, device=self.device)
        self.store = HostNodeStore(self.pool)
        self.lines = HostLineStore(HostLineConfig(byte_budget=int(line_budget)))
        self.store.drop_listeners.append(lambda e: self.lines.drop(e.key))
        self.units_per_block = self.shape.num_layers * self.shape.num_kv_heads
        cap = self.pool.cache.capacity
        if cap < self.units_per_block:
            raise RuntimeError(f"sglang-sparse host tier: gpu_cache_mb={cfg.gpu_cache_mb} holds {cap} units; one "
                               f"KV page of all layers needs {self.units_per_block} ({self.pool.unit_bytes} B each)")
        self.blocks_per_chunk = max(1, min(cap, (_MAX_TRANSFER_MB << 20) // self.pool.unit_bytes)
                                    // self.units_per_block)
        rows = self.blocks_per_chunk * self.units_per_block
        path = "auto" if self.device.type == "cuda" else "torch_staging"
        self.io = HostTierIO(self.pool.host_units, self.pool.cache.cache_buf, max_rows=rows, path=path)
        self._pack = torch.empty((rows, self.pool.unit_elems), dtype=self.shape.dtype, device=self.device)
        self.stats = HostTierServerStats()
        self.metrics = metrics
        self.load_listeners: list = []   # f(pages: int64 device tensor) after pages were reloaded

    def report(self) -> dict:
        s = self.pool.stats()
        d = dict(self.stats.__dict__)
        d.update(host_nodes=len(self.store), host_tokens=self.store.tokens, host_bytes=s.host_bytes_used,
                 host_bytes_total=s.host_bytes_total, dropped_nodes=self.store.dropped,
                 host_line_bytes=self.lines.bytes, host_line_nodes=len(self.lines),
                 host_line_turns=self.lines.num_turns, host_line_evicted_turns=self.lines.evicted_turns,
                 host_line_dropped_turns=self.lines.dropped_turns,
                 unit_cache_hits=s.hits, unit_cache_misses=s.misses, gpu_cache_hit_rate=s.hit_rate,
                 gathered_gbps=(self.stats.gathered_bytes / self.stats.gather_seconds / 1e9
                                if self.stats.gather_seconds else None), gather_path=self.io.gather.path)
        return d

    def _publish(self) -> None:
        m = self.metrics
        if m is None:
            return
        r = self.report()
        m.host_bytes.set(r["host_bytes"])
        m.host_nodes.set(r["host_nodes"])
        m.host_line_bytes.set(r["host_line_bytes"])
        m.hit_rate.set(r["gpu_cache_hit_rate"])
        if r["gathered_gbps"] is not None:
            m.gather_gbps.set(r["gathered_gbps"])

    # ---------------------------------------------------------------- save
    def save(self, items: list) -> None:
        """``items``: ``(extra_key, prefix tokens, start, tokens, slots[, lines])`` of evicted nodes (slots:
        int64 device ``[len(tokens)]``, page-aligned, freed but not yet reused; lines: the node's LoopServe
        :class:`NodeLines` or None). Packs and saves their pages; the lines go with the host entry."""
        p = self.page_size
        pages_all, blocks_all = [], []
        for extra_key, prefix, start, tokens, slots, *rest in items:
            lines = rest[0] if rest else None
            path = list(prefix[:start]) + list(tokens)
            chain = self.store.find_chain(extra_key, path, start, len(path))
            if sum(m for _, m in chain) == len(tokens):
                self.stats.save_skipped_nodes += 1
                if lines is not None:
                    self._replace_lines(chain, lines)
                continue
            blocks = self.store.reserve(len(tokens) // p)
            if blocks is None:
                self.stats.unsaved_nodes += 1
                if lines is not None:
                    self.stats.line_turns_dropped += lines.num_turns
                continue
            entry = self.store.add(extra_key, prefix, start, tokens, blocks)
            if lines is not None:
                self._keep_lines(entry.key, lines)
            pages_all.append(slots[::p] // p)
            blocks_all.append(blocks)
            self.stats.saved_nodes += 1
            self.stats.saved_tokens += len(tokens)
            if self.metrics is not None:
                self.metrics.saved_nodes.inc()
                self.metrics.saved_tokens.inc(len(tokens))
        if pages_all:
            self._save_pages(torch.cat(pages_all), torch.cat(blocks_all))
        self._publish()

    def _keep_lines(self, key, lines) -> None:
        if self.lines.put(key, lines):
            self.stats.line_turns_saved += lines.num_turns
        else:
            self.stats.line_turns_dropped += lines.num_turns

    def _replace_lines(self, chain: list, lines) -> None:
        """An evicted node whose KV is already held by the host entries ``chain`` (a reloaded node): its
        current lines replace those entries' (split at the entries' boundaries); the part of an entry the node
        covers only partly is dropped (that entry keeps its own lines)."""
        bounds = [lines.start]
        for e, m in chain:
            bounds.append(bounds[-1] + m)
        for (e, m), part in zip(chain, partition_lines(lines, bounds)):
            if part is None:
                continue
            if m == e.num_tokens:
                self._keep_lines(e.key, part)
            else:
                self.stats.line_turns_dropped += part.num_turns

    def reattach_lines(self, chain: list, saved: list, node, start: int, end: int, radix) -> None:
        """After a load of ``chain`` (``(entry, used tokens)``) into ``node`` (expected to hold ``[start,
        end)``): attach the entries' kept lines ``saved`` (one :class:`NodeLines` or None per chain item) to
        ``node`` through ``radix`` (:class:`sglang_sparse.loopserve.radix.RadixLines`)."""
        parts = [(ln, e.start + m) for (e, m), ln in zip(chain, saved) if ln is not None]
        if not parts:
            return
        n_turns = sum(ln.num_turns for ln, _ in parts)
        node_start, node_end = _depth(node.parent), _depth(node)
        if (node_start, node_end) != (start, end):
            self.stats.line_mismatches += 1
            self.stats.line_turns_dropped += n_turns
            logger.warning("sglang-sparse host tier: reloaded node holds [%d, %d), loaded [%d, %d): its %d line "
                           "set(s) dropped", node_start, node_end, start, end, n_turns)
            return
        lines = restore_lines(parts, start, end)
        ok, bad = radix.give(node, lines, self.device) if lines is not None else (0, 0)
        self.stats.line_turns_restored += ok
        self.stats.line_turns_dropped += bad
        if self.metrics is not None and ok:
            self.metrics.restored_line_turns.inc(ok)

    def _save_pages(self, pages: torch.Tensor, blocks: torch.Tensor) -> None:
        from flashinfer_ext.host_tier.kv_units import pack_pages

        saver, c, u = self.io.saver, self.blocks_per_chunk, self.units_per_block
        for i in range(0, pages.numel(), c):
            pg, bl = pages[i:i + c], blocks[i:i + c]
            saver.wait()  # the previous chunk's copy has left the pack buffer
            rows = self._pack[: pg.numel() * u]
            pack_pages(self.k_bufs, self.v_bufs, pg.to(self.device, torch.int64), self.page_size, rows)
            saver.save(rows, self.pool.unit_ids(bl))

    # ---------------------------------------------------------------- load
    def load(self, chain: list, slots: torch.Tensor) -> None:
        """Copy the first ``m`` tokens of each ``(entry, m)`` of ``chain`` into ``slots`` (int64 device,
        page-aligned, ``sum(m)`` long) through the GPU unit cache; asynchronous on CUDA (ordered before
        later work on the current stream)."""
        from flashinfer_ext.host_tier.kv_units import unpack_units

        p = self.page_size
        blocks = torch.cat([e.blocks[: m // p] for e, m in chain])
        pages = (slots[::p] // p).to(torch.int64)
        c, cache = self.blocks_per_chunk, self.pool.cache.cache_buf
        t0 = time.perf_counter()
        for i in range(0, blocks.numel(), c):
            bl, pg = blocks[i:i + c], pages[i:i + c]
            plan = self.pool.acquire(self.pool.unit_ids(bl))
            self.io.run(plan.load_units, plan.load_slots, plan.save_slots, plan.save_units)
            self.io.wait()
            rows = cache.index_select(0, plan.slots.to(self.device))
            unpack_units(rows, self.k_bufs, self.v_bufs, pg, p)
        for f in self.load_listeners:
            f(pages)
        if self.device.type == "cuda":  # timing only: the scheduler is about to sync on this batch anyway
            torch.cuda.current_stream(self.device).synchronize()
        self.stats.gather_seconds += time.perf_counter() - t0
        self.stats.gathered_bytes += blocks.numel() * self.pool.block_bytes

    def close(self) -> None:
        self.io.close()


# ------------------------------------------------------------------------------------------- tree
def _path_tokens(node) -> list:
    """Token ids on the path from the root to the end of ``node``."""
    parts = []
    while node is not None and node.parent is not None:
        parts.append(node.key.raw_token_ids())
        node = node.parent
    out: list = []
    for seg in reversed(parts):
        out.extend(seg)
    return out


class HostTierRadixCache(RadixCache):
    """Stock ``RadixCache`` whose evicted nodes go to the host tier and come back on a hit (module doc)."""

    def __init__(self, params, tier: HostTier):
        self.tier = tier
        self._evicting: list | None = None
        super().__init__(params)
        if self.is_eagle:
            raise RuntimeError("sglang-sparse host tier: EAGLE bigram keys are not supported")

    # ---------------------------------------------------------------- eviction -> host
    def evict(self, params: EvictParams):
        outer = self._evicting is None
        if outer:
            self._evicting = []
        try:
            result = super().evict(params)
        finally:
            if outer:
                items, self._evicting = self._evicting, None
        if outer and items:
            self.tier.save(items)
        return result

    def _delete_leaf(self, node):
        if self._evicting is not None and node.value is not None and len(node.key) > 0:
            prefix = _path_tokens(node.parent)
            tokens = list(node.key.raw_token_ids())
            radix = lines_of(self)
            lines = radix.take(node, len(prefix)) if radix is not None else None  # before loopserve frees them
            self._evicting.append((node.key.extra_key, prefix, len(prefix), tokens, node.value, lines))
        return super()._delete_leaf(node)

    def reset(self):
        super().reset()
        tier = getattr(self, "tier", None)
        if tier is not None:
            tier.io.flush()
            tier.store.clear()
            tier.lines.clear()
            tier._publish()

    # ---------------------------------------------------------------- host hits
    def _host_chain(self, key: RadixKey, matched: int) -> list:
        key = key.page_aligned(self.page_size)
        return self.tier.store.find_chain(key.extra_key, key.raw_token_ids(), matched, len(key))

    def match_prefix(self, params: MatchPrefixParams):
        result = super().match_prefix(params)
        if params.req is None or self.disable or len(self.tier.store) == 0:
            return result
        chain = self._host_chain(params.key, len(result.device_indices))
        hit = sum(m for _, m in chain)
        if hit == 0:
            return result
        return result._replace(host_hit_length=hit, best_match_node=result.last_device_node)

    def init_load_back(self, params: InitLoadBackParams):
        """Load the host entries continuing the request's device match into fresh GPU pages, insert them,
        and return ``(their slots, new last node)``; on failure ``(empty, the matched node)``."""
        req, node = params.req, params.best_match_node
        empty = self._empty_match_result.device_indices
        if req is None or params.host_hit_length <= 0:
            return empty, node
        tokens = req.full_untruncated_fill_ids
        matched = len(req.prefix_indices)
        key = RadixKey(tokens, req.extra_key, limit=matched + params.host_hit_length)
        chain = self._host_chain(key, matched)
        n = sum(m for _, m in chain)
        req.host_hit_length = 0
        if n == 0:
            return empty, node
        saved = [self.tier.lines.get(e.key) for e, _ in chain]  # immutable: safe whatever happens to the entries
        for e, _ in chain:
            e.pins += 1
        self.inc_lock_ref(node)
        try:
            slots = self.token_to_kv_pool_allocator.alloc(n)
            if slots is None:
                self.evict(EvictParams(num_tokens=n))
                slots = self.token_to_kv_pool_allocator.alloc(n)
            if slots is None:
                self.tier.stats.failed_loads += 1
                if self.tier.metrics is not None:
                    self.tier.metrics.failed_loads.inc()
                logger.warning("sglang-sparse host tier: no GPU memory to load %d tokens (evictable %d); "
                               "recomputing them", n, self.evictable_size_)
                return empty, node
            self.tier.load(chain, slots)
        finally:
            for e, _ in chain:
                e.pins -= 1
            self.dec_lock_ref(node)
        full = torch.cat([req.prefix_indices.to(torch.int64), slots.to(torch.int64)])
        res = self.insert(InsertParams(key=RadixKey(tokens[: matched + n], req.extra_key), value=full, priority=getattr(req, "priority", 0) or 0))
        if res.prefix_len != matched:  # the path changed under us: give the duplicate slots back
            self.token_to_kv_pool_allocator.free(slots)
            raise RuntimeError(f"sglang-sparse host tier: insert found {res.prefix_len} cached tokens, expected "
                               f"{matched}")
        radix = lines_of(self)
        if radix is not None:
            self.tier.reattach_lines(chain, saved, res.last_device_node, matched, matched + n, radix)
        st = self.tier.stats
        st.loads += 1
        st.loaded_nodes += len(chain)
        st.loaded_tokens += n
        req.host_hit_length = n
        if self.tier.metrics is not None:
            self.tier.metrics.loads.inc()
            self.tier.metrics.loaded_tokens.inc(n)
        self.tier._publish()
        return slots.to(torch.int64), res.last_device_node
