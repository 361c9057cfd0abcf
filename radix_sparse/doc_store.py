"""Per-document KV entries for SamKV reuse (pure torch/python, no sglang import).

Supports: each document of a multi-document request is prefilled alone at positions ``[0, n)``; its
per-layer K/V tensors are stored here under a key made of a hash of its token ids and an optional
``cache_salt``, found again by any later request that carries the same tokens and the same salt
(wherever it places the document: keys are re-rotated by ``flashinfer_ext.rope_shift`` at use,
values are reused as they are), reference-counted while requests use them, and evicted
least-recently-used among unreferenced entries under a byte budget.

Definitions (the contract the property tests check):
  * ``DocKey`` = (sha256 of the token ids as little-endian int64, number of tokens, salt). Entries
    with different salts never match, even with identical tokens (``None`` is a salt of its own:
    the shared, unsalted namespace). Identical tokens + identical salt always match while the entry
    is stored. Collisions are treated as impossible (256-bit digest); token ids are not kept.
  * An entry holds ``k[layer]``, ``v[layer]`` tensors whose first dim is the document's token count
    (``[num_tokens, num_kv_heads, head_dim]`` for K/V, or any per-token handle tensor such as pool
    slot indices), the token count and the position the keys were computed at (``position``, 0 for
    SamKV documents).
  * ``bytes`` = sum over stored entries of ``numel * element_size`` of every tensor they hold (the
    logical size; the store does not copy, so pass compact tensors, not views of a larger buffer).
    ``bytes <= byte_budget`` always: an insert that cannot fit even after evicting every
    unreferenced entry is refused (returns ``None``, nothing is evicted for it) and counted.
  * ``acquire``/``release`` count users per entry; a release below zero raises ``ValueError``.
    Referenced entries (refcount > 0) are never evicted. ``lookup(..., acquire=True)`` returns the
    entry already acquired (the usual path of a request).
  * ``hits``/``misses`` count lookups; inserting an already stored key returns the stored entry
    (first writer wins, the new tensors are dropped) and counts as neither.

Cautions: all bookkeeping is host-side python (OrderedDict LRU); tensors stay on the device they
were given on and are never copied or moved (no host tier yet). Not thread-safe (the scheduler is
single-threaded). Eviction walks the LRU order from the cold end, skipping referenced entries:
O(entries) worst case per insert.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

import torch

__all__ = ["DocStoreConfig", "DocKey", "DocEntry", "DocStoreStats", "DocStore", "doc_key"]

_MAX_BUDGET = 1 << 50
_MAX_SALT = 1024


@dataclass(frozen=True)
class DocStoreConfig:
    """Limits of the document store."""

    byte_budget: int = 4 << 30
    """bytes of stored K/V tensors, at most (integer in [0, 2**50])."""
    max_entries: int = 1 << 20
    """stored documents, at most (integer in [1, 2**30]); the LRU evicts past it like past the budget."""

    def __post_init__(self) -> None:
        for name, lo, hi in (("byte_budget", 0, _MAX_BUDGET), ("max_entries", 1, 1 << 30)):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int) or not lo <= val <= hi:
                raise ValueError(f"DocStoreConfig.{name}={val!r} is out of range: "
                                 f"expected an integer in [{lo}, {hi}]")


@dataclass(frozen=True)
class DocKey:
    """Identity of a document entry: content digest, token count and cache salt."""

    digest: bytes
    num_tokens: int
    salt: str | None


def _token_bytes(token_ids) -> tuple[bytes, int]:
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dim() != 1 or token_ids.dtype.is_floating_point or token_ids.dtype == torch.bool:
            raise ValueError(f"token_ids must be a 1-D integer tensor or sequence of ints, got tensor "
                             f"{token_ids.dtype} {tuple(token_ids.shape)}")
        t = token_ids.detach().to("cpu", torch.int64).contiguous()
    else:
        ids = list(token_ids)
        if any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
            raise ValueError("token_ids must be a 1-D integer tensor or sequence of ints")
        t = torch.tensor(ids, dtype=torch.int64)
    if t.numel() == 0:
        raise ValueError("token_ids is empty: a document has at least one token")
    return t.numpy().astype("<i8", copy=False).tobytes(), int(t.numel())


def doc_key(token_ids: Sequence[int] | torch.Tensor, cache_salt: str | None = None) -> DocKey:
    """Key of a document: sha256 over (salt, token ids as little-endian int64). ``token_ids``: 1-D ints."""
    if cache_salt is not None and (not isinstance(cache_salt, str) or len(cache_salt) > _MAX_SALT):
        raise ValueError(f"cache_salt must be None or a string of at most {_MAX_SALT} characters, "
                         f"got {type(cache_salt).__name__}")
    raw, n = _token_bytes(token_ids)
    h = hashlib.sha256()
    h.update(b"\x00" if cache_salt is None else b"\x01" + cache_salt.encode("utf-8") + b"\x00")
    h.update(raw)
    return DocKey(h.digest(), n, cache_salt)


@dataclass(frozen=True)
class DocEntry:
    """One stored document: per-layer ``k[l]``, ``v[l]`` (first dim ``num_tokens``), computed at
    ``position`` (the absolute position of its first token when it was prefilled; 0 for SamKV)."""

    key: DocKey
    k: tuple[torch.Tensor, ...]
    v: tuple[torch.Tensor, ...]
    position: int = 0
    nbytes: int = field(default=0, compare=False)

    @property
    def num_tokens(self) -> int:
        return self.key.num_tokens

    @property
    def num_layers(self) -> int:
        return len(self.k)


@dataclass(frozen=True)
class DocStoreStats:
    """Snapshot of the store's memory and traffic counters."""

    bytes: int
    entries: int
    referenced: int
    byte_budget: int
    hits: int
    misses: int
    inserts: int
    refused: int
    evictions: int

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class DocStore:
    """Byte-bounded, reference-counted LRU of per-document KV entries (see module docstring)."""

    def __init__(self, config: DocStoreConfig | None = None) -> None:
        self.config = config or DocStoreConfig()
        self._entries: OrderedDict[DocKey, DocEntry] = OrderedDict()  # cold -> hot
        self._refs: dict[DocKey, int] = {}
        self._bytes = 0
        self._hits = self._misses = self._inserts = self._refused = self._evictions = 0

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: DocKey) -> bool:
        return key in self._entries

    @property
    def bytes(self) -> int:
        return self._bytes

    def refcount(self, key: DocKey) -> int:
        """Users of a stored entry (``KeyError`` if it is not stored)."""
        if key not in self._entries:
            raise KeyError("document entry is not stored")
        return self._refs[key]

    def peek(self, key: DocKey) -> DocEntry | None:
        """Stored entry or ``None``, without counting a hit/miss, touching the LRU or acquiring."""
        return self._entries.get(key)

    def keys(self) -> list[DocKey]:
        """Stored keys, least recently used first."""
        return list(self._entries)

    def stats(self) -> DocStoreStats:
        return DocStoreStats(self._bytes, len(self._entries), sum(1 for r in self._refs.values() if r > 0),
                             self.config.byte_budget, self._hits, self._misses, self._inserts,
                             self._refused, self._evictions)

    # ------------------------------------------------------------------ lookups
    def lookup(self, token_ids: Sequence[int] | torch.Tensor | DocKey, cache_salt: str | None = None,
               *, acquire: bool = True) -> DocEntry | None:
        """Entry for these tokens + salt (a ``DocKey`` may be passed instead), or ``None``.

        Counts a hit or a miss and marks a hit most recently used; ``acquire`` takes a reference
        (release it with :meth:`release` when the request is done).
        """
        key = token_ids if isinstance(token_ids, DocKey) else doc_key(token_ids, cache_salt)
        entry = self._entries.get(key)
        if entry is None:
            self._misses += 1
            return None
        self._hits += 1
        self._entries.move_to_end(key)
        if acquire:
            self._refs[key] += 1
        return entry

    def acquire(self, key: DocKey) -> None:
        """Take a reference on a stored entry (``KeyError`` if not stored)."""
        if key not in self._entries:
            raise KeyError("acquire of a document entry that is not stored")
        self._refs[key] += 1
        self._entries.move_to_end(key)

    def release(self, key: DocKey) -> None:
        """Drop a reference; ``ValueError`` if the entry holds none, ``KeyError`` if not stored."""
        if key not in self._entries:
            raise KeyError("release of a document entry that is not stored")
        if self._refs[key] <= 0:
            raise ValueError("release of a document entry whose refcount is already 0")
        self._refs[key] -= 1

    # ------------------------------------------------------------------ updates
    def insert(self, token_ids: Sequence[int] | torch.Tensor, k: Sequence[torch.Tensor],
               v: Sequence[torch.Tensor], *, cache_salt: str | None = None, position: int = 0,
               acquire: bool = False) -> DocEntry | None:
        """Store a document's KV; return its entry, or ``None`` when it cannot fit.

        k, v: one tensor per layer (same number of layers, each with first dim = number of tokens;
        K/V: ``[num_tokens, num_kv_heads, head_dim]`` any dtype/device). An already stored key
        returns the stored entry untouched (new tensors dropped). To make room, unreferenced entries
        are evicted least recently used first, but only if that makes the new entry fit.
        ``acquire`` takes a reference on the returned entry.
        """
        key = doc_key(token_ids, cache_salt)
        if isinstance(position, bool) or not isinstance(position, int) or position < 0:
            raise ValueError(f"position={position!r} is out of range: expected an integer >= 0")
        k, v = tuple(k), tuple(v)
        if not k or len(k) != len(v):
            raise ValueError(f"k and v must hold one tensor per layer (same count, >= 1); got "
                             f"{len(k)} and {len(v)}")
        for name, ts in (("k", k), ("v", v)):
            for layer, t in enumerate(ts):
                if not isinstance(t, torch.Tensor) or t.dim() < 1 or t.shape[0] != key.num_tokens:
                    shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                    raise ValueError(f"{name}[{layer}] must be a tensor with first dim num_tokens="
                                     f"{key.num_tokens}, got {shape}")
        stored = self._entries.get(key)
        if stored is not None:
            self._entries.move_to_end(key)
            if acquire:
                self._refs[key] += 1
            return stored
        nbytes = sum(_tensor_bytes(t) for t in k) + sum(_tensor_bytes(t) for t in v)
        if not self._make_room(nbytes, 1):
            self._refused += 1
            return None
        entry = DocEntry(key, k, v, position, nbytes)
        self._entries[key] = entry
        self._refs[key] = 1 if acquire else 0
        self._bytes += nbytes
        self._inserts += 1
        return entry

    def evict(self, num_bytes: int) -> int:
        """Evict unreferenced entries, least recently used first, until ``num_bytes`` are freed or
        none is left; return the bytes freed."""
        freed = 0
        for key in list(self._entries):
            if freed >= num_bytes:
                break
            if self._refs[key] == 0:
                freed += self._drop(key)
        return freed

    def remove(self, key: DocKey) -> bool:
        """Drop an unreferenced entry now (``ValueError`` if referenced); False if not stored."""
        if key not in self._entries:
            return False
        if self._refs[key] > 0:
            raise ValueError(f"remove of a referenced document entry (refcount {self._refs[key]})")
        self._drop(key)
        return True

    # ------------------------------------------------------------------ internals
    def _drop(self, key: DocKey) -> int:
        entry = self._entries.pop(key)
        del self._refs[key]
        self._bytes -= entry.nbytes
        self._evictions += 1
        return entry.nbytes

    def _make_room(self, nbytes: int, n_new: int) -> bool:
        """Evict LRU unreferenced entries so that ``nbytes`` more bytes and ``n_new`` more entries fit;
        evict nothing (return False) if even evicting every unreferenced entry would not do."""
        budget, cap = self.config.byte_budget, self.config.max_entries
        if self._bytes + nbytes <= budget and len(self._entries) + n_new <= cap:
            return True
        free_bytes = sum(e.nbytes for kk, e in self._entries.items() if self._refs[kk] == 0)
        free_entries = sum(1 for r in self._refs.values() if r == 0)
        if self._bytes - free_bytes + nbytes > budget or len(self._entries) - free_entries + n_new > cap:
            return False
        for key in list(self._entries):
            if self._bytes + nbytes <= budget and len(self._entries) + n_new <= cap:
                break
            if self._refs[key] == 0:
                self._drop(key)
        return True
