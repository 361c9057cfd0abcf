"""Per-turn LoopServe lines on the stock radix cache's nodes (:class:`radix_sparse.LineStore`).

Hooks on SGLang's ``RadixCache`` (no subclass, no patched file; they are no-ops unless the
scheduler process serves ``--sparse loopserve``):
  * AFTER ``cache_unfinished_req`` / ``cache_finished_req``: a request whose prefill is done attaches
    its line sets (union over its chunks, all layers and KV heads) to the radix node holding the
    turn's first token (found by a prefix match over the prompt: the node SGLang just inserted);
  * AFTER ``_split_node``: :meth:`LineStore.split` at the absolute position of the cut;
  * AFTER ``_delete_leaf`` (eviction): :meth:`LineStore.free`; AFTER ``reset``: a new store. Under the host
    tier (``host_tier_gb > 0``) an evicted leaf's entries are taken out first (:meth:`RadixLines.take`,
    called by ``HostTierRadixCache._delete_leaf``) and move to the host with the node's KV; when the node is
    loaded back they are attached to the node holding the reloaded tokens (:meth:`RadixLines.give`), so the
    next turn reuses them (``sglang_sparse.host_tier.cache``).
The next turn's request, whose prefix match ends inside or after that node, gets the union of the
lines on its matched path (:meth:`RadixLines.lookup`, called while the batch is planned) and
reuses them in prefill (union with its own selection) and decode (Alg. 3's "lines of all turns").

Bookkeeping is host-side (the scheduler thread); line tensors stay on the device. Nodes are not
refcounted in the store: lines are only read while a batch is planned, and an evicted node's lines
go with it (to the host tier when it keeps the node, else they are freed). The store's memory is bounded by
``line_store_mb`` (LRU eviction of entries); the host tier's copies by another ``line_store_mb``.
"""

from __future__ import annotations

import logging

from radix_sparse.line_store import LineStore, LineStoreConfig, TurnLines

logger = logging.getLogger("sglang_sparse")

LINES_ATTR = "sparse_radix_lines"  # on SGLang's radix cache: its RadixLines (--sparse loopserve), see lines_of


class RadixLines:
    def __init__(self, config, stats, metrics):
        self.config = config
        self.stats = stats
        self.metrics = metrics
        self.store = LineStore(LineStoreConfig(byte_budget=int(config.line_store_mb) << 20))

    def _report(self) -> None:
        self.stats.line_store_bytes = self.store.bytes
        if self.metrics is not None:
            self.metrics.store_bytes.set(self.store.bytes)

    # the request side -------------------------------------------------------------------------
    def lookup(self, req, prefix_len: int):
        """Union of the lines of earlier turns held completely by the request's matched prefix (or None)."""
        node = getattr(req, "last_node", None)
        path = []
        while node is not None and getattr(node, "parent", None) is not None:
            path.append(node.id)
            node = node.parent
        if not path:
            return None
        return self.store.lines_for_path(reversed(path), complete_to=prefix_len)

    def attach(self, tree, req) -> None:
        from sglang_sparse.loopserve.runner import STATE_ATTR

        st = getattr(req, STATE_ATTR, None)
        if st is None or not st.prefill_done or st.attached:
            return
        st.attached = True
        st.finalize()
        node = _node_at(tree, req, st.turn_start, st.prompt_len)
        if node is None:
            return
        v_idx, v_cnt, s_idx, s_cnt = st.lines
        lines = TurnLines(st.turn_start, st.prompt_len, v_idx, v_cnt, s_idx, s_cnt)
        if self.store.attach(node.id, ("turn", req.rid), lines):
            self.stats.stored_turns += 1
            if self.metrics is not None:
                self.metrics.stored_turns.inc()
        self._report()


    # the host tier side ----------------------------------------------------------------------
    def take(self, node, start: int):
        """Remove the entries of ``node`` (about to leave the tree; it holds ``[start, start + len(key))``)
        and return them as a :class:`NodeLines` (device tensors), or None when it owned none."""
        from radix_sparse.host_lines import NodeLines

        entries = self.store.detach(node.id)
        self._report()
        if not entries:
            return None
        return NodeLines(start, start + len(node.key), tuple(entries.items()))

    def give(self, node, lines, device) -> tuple[int, int]:
        """Attach ``lines`` (a :class:`NodeLines` of ``node``'s range) to ``node`` with tensors on ``device``;
        returns ``(turns attached, turns refused by the budget)``."""
        ok = bad = 0
        for turn, ln in lines.to(device).turns:
            if turn not in self.store.entries(node.id) and self.store.attach(node.id, turn, ln):
                ok += 1
            else:
                bad += 1
        self._report()
        return ok, bad


def lines_of(tree) -> "RadixLines | None":
    """The line store kept on radix cache ``tree`` (``--sparse loopserve``), or None: the attention backend builds it
    (``backend.sparse_tree_state``) and ``runtime_hooks.scheduler_init_hook`` puts it on the scheduler's tree."""
    return getattr(tree, LINES_ATTR, None)


def _node_at(tree, req, pos: int, prompt_len: int):
    """The radix node holding absolute position ``pos`` of the request's prompt (None if not cached)."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    key = RadixKey(req.origin_input_ids[:prompt_len], req.extra_key).page_aligned(tree.page_size)
    node = tree.match_prefix(MatchPrefixParams(key=key)).last_device_node
    chain = []
    while node is not None and node is not tree.root_node:
        chain.append(node)
        node = node.parent
    start = 0
    for n in reversed(chain):
        end = start + len(n.key)
        if start <= pos < end:
            return n
        start = end
    return None


def node_depth(node) -> int:
    """Tokens on the path from the root to the end of a radix ``node``."""
    d = 0
    while node is not None and node.parent is not None:
        d += len(node.key)
        node = node.parent
    return d


# ------------------------------------------------------------------------------ RadixCache hooks
def cache_req_hook(result, tree, req, *args, **kwargs):
    """AFTER ``RadixCache.cache_unfinished_req`` / ``cache_finished_req``."""
    radix = lines_of(tree)
    if radix is not None and not getattr(tree, "disable", False):
        radix.attach(tree, req)
    return result


def split_hook(result, tree, key, child, split_len, *args, **kwargs):
    """AFTER ``RadixCache._split_node``: ``result`` is the new parent holding the first ``split_len`` tokens."""
    radix = lines_of(tree)
    if radix is not None and result is not None and radix.store.entries(child.id):
        radix.store.split(child.id, result.id, node_depth(result))
        radix._report()
    return result


def delete_leaf_hook(result, tree, node, *args, **kwargs):
    """AFTER ``RadixCache._delete_leaf``."""
    radix = lines_of(tree)
    if radix is not None and radix.store.entries(node.id):
        radix.store.free(node.id)
        radix._report()
    return result


def reset_hook(result, tree, *args, **kwargs):
    """AFTER ``RadixCache.reset``."""
    radix = lines_of(tree)
    if radix is not None:
        radix.store = LineStore(radix.store.config)
        radix._report()
    return result
