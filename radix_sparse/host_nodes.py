"""Host-resident radix nodes: the KV of radix-tree nodes evicted from the GPU, kept in a
:class:`~radix_sparse.host_pool.HostBlockPool` and found again by a later prefix match (pure python +
torch, no sglang import).

An entry is the KV of one evicted node: the node's token ids ``tokens`` (page-aligned, ``len(tokens) ==
len(blocks) * page_size``), the absolute position ``start`` of its first token, and the host blocks
``blocks`` (int64 ``[len(tokens) // page_size]``, one host block per KV page, all layers and KV heads).
It is addressed by its *path*: ``(extra_key, start, digest(prefix tokens [0, start)), first page of
tokens)``, i.e. the same thing a radix tree's child key identifies under a given parent, so a request
whose device match ends at ``start`` with the same prefix finds it (:meth:`HostNodeStore.find_chain`),
also as a chain of entries (a parent evicted after its child).

Entries are immutable and content-addressed (the KV of a token path is the same whoever computed it),
so an entry stays valid after its KV went back to the GPU: evicting that node again needs no second
save (:meth:`HostNodeStore.covered`, also when the reloaded node spans several entries). Host memory is bounded by the pool: :meth:`reserve` drops the
least recently used entries not pinned by an ongoing load; an entry that cannot fit is not stored.

Other per-node data (LoopServe line sets: :mod:`radix_sparse.host_lines`) is kept beside an entry under its
``key`` and follows its life through :attr:`HostNodeStore.drop_listeners` (called whenever an entry is dropped).

Limitations: a match that ends strictly inside an entry's range (the GPU tree holds a longer prefix
than the entry's start) does not find it (the tokens after the GPU match are recomputed).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

import torch

from radix_sparse.host_pool import HostBlockPool

__all__ = ["HostNode", "HostNodeStore", "prefix_digest"]


def prefix_digest(tokens: Sequence[int]) -> bytes:
    """16-byte blake2b digest of a token id sequence (list, tuple or ``array('q')``)."""
    buf = tokens if isinstance(tokens, array) and tokens.typecode == "q" else array("q", tokens)
    return hashlib.blake2b(buf.tobytes(), digest_size=16).digest()


@dataclass
class HostNode:
    """One evicted node's KV on the host (see module docstring)."""

    extra_key: Hashable
    start: int
    tokens: tuple
    blocks: torch.Tensor
    pins: int = 0
    key: tuple = field(default=(), repr=False)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


class HostNodeStore:
    """Index of :class:`HostNode` entries over one :class:`HostBlockPool`, LRU by use.

    ``page_size`` tokens per host block (the pool's ``config.page_size``). Not thread-safe (the
    scheduler thread owns it).
    """

    def __init__(self, pool: HostBlockPool) -> None:
        self.pool = pool
        self.page_size = pool.config.page_size
        self._entries: "OrderedDict[tuple, HostNode]" = OrderedDict()
        self.tokens = 0
        self.dropped = 0      # entries dropped to make room (LRU)
        self.refused = 0      # entries that could not be stored (larger than the unpinned pool)
        self.drop_listeners: list = []  # f(entry) after an entry was dropped (e.g. its host line sets go too)

    # ------------------------------------------------------------------ keys
    def _key(self, extra_key: Any, start: int, prefix: Sequence[int], first_page: Sequence[int]) -> tuple:
        return (extra_key, start, prefix_digest(prefix[:start]), tuple(first_page[: self.page_size]))

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self.pool.blocks_used * self.pool.block_bytes

    # ------------------------------------------------------------------ store
    def reserve(self, n_blocks: int) -> torch.Tensor | None:
        """``n_blocks`` host blocks, dropping LRU unpinned entries as needed; ``None`` (nothing dropped)
        when the pool minus the pinned entries cannot hold them."""
        pool = self.pool
        if n_blocks > pool.num_blocks - sum(e.blocks.numel() for e in self._entries.values() if e.pins):
            self.refused += 1
            return None
        while pool.blocks_free < n_blocks:
            victim = next(e for e in self._entries.values() if not e.pins)
            self.drop(victim)
            self.dropped += 1
        return pool.alloc(n_blocks)

    def add(self, extra_key: Any, prefix: Sequence[int], start: int, tokens: Sequence[int],
            blocks: torch.Tensor) -> HostNode:
        """Store an entry whose KV was (or is being) saved into ``blocks``; replaces an entry on the same
        path (its blocks are freed)."""
        p = self.page_size
        if len(tokens) == 0 or len(tokens) % p or blocks.numel() != len(tokens) // p:
            raise ValueError(f"entry of {len(tokens)} tokens needs a multiple of page_size={p} tokens and one "
                             f"block per page, got {blocks.numel()} blocks")
        key = self._key(extra_key, start, prefix, tokens)
        old = self._entries.get(key)
        if old is not None:
            if old.pins:
                raise RuntimeError("replacing a host node that is being loaded")
            self.drop(old)
        e = HostNode(extra_key, start, tuple(tokens), blocks.to("cpu", torch.int64), key=key)
        self._entries[key] = e
        self.tokens += e.num_tokens
        return e

    def drop(self, e: HostNode) -> None:
        """Forget an entry and free its host blocks (their units leave the GPU unit cache)."""
        if self._entries.get(e.key) is not e:
            raise KeyError("host node is not stored")
        del self._entries[e.key]
        self.tokens -= e.num_tokens
        self.pool.free(e.blocks)
        for f in self.drop_listeners:
            f(e)

    def clear(self) -> None:
        for e in list(self._entries.values()):
            if not e.pins:
                self.drop(e)

    # ------------------------------------------------------------------ lookup
    def find_chain(self, extra_key: Any, key_tokens: Sequence[int], matched: int,
                   limit: int) -> list[tuple[HostNode, int]]:
        """Entries continuing a device match of ``matched`` tokens of ``key_tokens``, in order, each with
        the number of its tokens that match (page-aligned, > 0), covering at most ``limit`` tokens in
        total (``matched + sum <= limit``). An entry may be used partly and continued by another entry
        starting where the used part ends. Refreshes LRU."""
        p = self.page_size
        out: list[tuple[HostNode, int]] = []
        pos = matched
        while pos + p <= limit:
            e = self._entries.get(self._key(extra_key, pos, key_tokens, key_tokens[pos: pos + p]))
            if e is None:
                break
            n = min(e.num_tokens, limit - pos)
            m = 0
            seg = key_tokens[pos: pos + n]
            while m < n and seg[m] == e.tokens[m]:
                m += 1
            m -= m % p
            if m == 0:
                break
            self._entries.move_to_end(e.key)
            out.append((e, m))
            pos += m  # a partly used entry may be continued by another one starting at pos (a sibling path)
        return out

    def covered(self, extra_key: Any, prefix: Sequence[int], start: int, tokens: Sequence[int]) -> bool:
        """Whether stored entries already hold all of ``tokens`` at ``start`` after ``prefix`` (then an
        evicted node with these tokens needs no save). Refreshes the LRU rank of those entries."""
        path = list(prefix[:start]) + list(tokens)
        return sum(m for _, m in self.find_chain(extra_key, path, start, len(path))) == len(tokens)
