"""Per-turn LoopServe line sets attached to radix-tree nodes (pure torch/python, no sglang import).

Supports: for every prefilled turn, its selected vertical key positions and slash offsets per
layer, per KV head (the ``VSSelection`` of each layer, stacked), stored on the radix node that
holds the turn's tokens, found again when a later request's prefix match walks through that
node, refcounted per node, split when the node splits, freed with it, and bounded by a byte
budget (least-recently-used unreferenced entries evicted first).

Definitions (the contract the property tests check):
  * A *turn* is the segment ``[turn_start, turn_end)`` of absolute positions prefilled in one
    forward (previous answer + new input); its lines are attached to the node holding those tokens.
  * An *entry* is (node, turn id) -> the part of a turn's lines that node owns. Vertical lines are
    absolute key positions (possibly in earlier turns). Slash offsets are relative, they belong to
    the turn as a whole and live on the node holding the turn's FIRST token.
  * ``split(node, new_parent, cut)`` mirrors a radix split at absolute position ``cut`` (the new
    parent holds the tokens before ``cut``, ``node`` keeps the rest): verticals ``< cut`` move to the
    parent (every prefix reaching the child also reaches the parent, and verticals before the node
    are within any such prefix), verticals ``>= cut`` stay; the slash offsets move to the parent iff
    ``turn_start < cut``. The parent inherits the node's refcount (as SGLang's ``_split_node`` does).
  * ``lines_for_path(nodes)`` of a matched prefix (root to the last matched node, in order) is the
    per (layer, head) union of its entries: for every turn that the prefix reaches (its first
    token is inside the prefix), the turn's verticals at positions where the prefix still shares the
    turn's tokens, and all its slash offsets, minus what the budget evicted (and verticals whose
    node the tree freed: they are gone even if the same tokens are cached again). Radix matches end at node boundaries (SGLang splits on match).
  * ``acquire``/``release`` count users per node (a request that matched the path holds it);
    ``free(node)`` drops the node's entries (a node is only freed unreferenced, else ``ValueError``).
  * ``bytes``/``num_entries`` report the stored tensors; ``bytes <= byte_budget`` always: an
    ``attach`` that cannot fit after evicting every unreferenced entry is refused (returns False;
    the turn then simply has no stored lines).

Cautions: all bookkeeping is host-side python; the line tensors stay on the device they were
given on (the union of a path is computed there with sorts, no per-line python loop). Node keys
are opaque hashables. Not thread-safe (the scheduler is single-threaded).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable, Iterable

import torch

__all__ = ["LineStoreConfig", "TurnLines", "LineStore", "split_turn_lines", "merge_turn_lines"]

_BIG = torch.iinfo(torch.int32).max


@dataclass(frozen=True)
class LineStoreConfig:
    """Memory bound of the line store."""

    byte_budget: int = 256 << 20
    """bytes of stored line tensors, at most (>= 0)."""

    def __post_init__(self) -> None:
        if isinstance(self.byte_budget, bool) or not isinstance(self.byte_budget, int) \
                or not 0 <= self.byte_budget <= 1 << 50:
            raise ValueError(f"LineStoreConfig.byte_budget={self.byte_budget!r} is out of range: "
                             f"expected an integer in [0, {1 << 50}]")


@dataclass(frozen=True)
class TurnLines:
    """Lines of one turn (or the part of it an entry owns). ``-1``-padded, verticals ascending.

    v_idx ``[L, H, Wv]`` int32 key positions, v_cnt ``[L, H]`` int32; s_idx ``[L, H, Ws]`` int32
    slash offsets, s_cnt ``[L, H]`` int32 (``Ws`` may be 0: no slash part).
    """

    turn_start: int
    turn_end: int
    v_idx: torch.Tensor
    v_cnt: torch.Tensor
    s_idx: torch.Tensor
    s_cnt: torch.Tensor

    def __post_init__(self) -> None:
        if not 0 <= self.turn_start < self.turn_end:
            raise ValueError(f"TurnLines turn=[{self.turn_start}, {self.turn_end}) is out of range: "
                             "expected 0 <= turn_start < turn_end")
        if self.v_idx.dim() != 3 or self.s_idx.dim() != 3 or self.v_cnt.shape != self.v_idx.shape[:2] \
                or self.s_cnt.shape != self.s_idx.shape[:2] or self.v_idx.shape[:2] != self.s_idx.shape[:2]:
            raise ValueError("TurnLines: expected v_idx/s_idx [L, H, W] and v_cnt/s_cnt [L, H]")

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.v_idx, self.v_cnt, self.s_idx, self.s_cnt))


def _compact(idx: torch.Tensor, keep: torch.Tensor, dedupe: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep ``idx[keep]`` per row of ``[L, H, W]``, ascending (optionally unique), ``-1``-padded to the
    largest count; returns ``(idx [L, H, W'], cnt [L, H])`` int32."""
    x = torch.where(keep, idx.to(torch.int64), _BIG).sort(dim=2).values
    if dedupe and x.shape[2] > 1:
        dup = torch.zeros_like(x, dtype=torch.bool)
        dup[:, :, 1:] = x[:, :, 1:] == x[:, :, :-1]
        x = torch.where(dup, _BIG, x).sort(dim=2).values
    valid = x < _BIG
    cnt = valid.sum(2, dtype=torch.int32)
    w = int(cnt.max()) if cnt.numel() else 0
    x = torch.where(valid, x, -1)[:, :, :w].to(torch.int32).contiguous()
    return x, cnt


def _valid(idx: torch.Tensor, cnt: torch.Tensor) -> torch.Tensor:
    return torch.arange(idx.shape[2], device=idx.device)[None, None, :] < cnt[:, :, None].long()


def split_turn_lines(ln: TurnLines, cut: int) -> tuple[TurnLines | None, TurnLines | None]:
    """The two parts of ``ln`` after a radix split at absolute position ``cut`` (module docstring):
    ``(parent part, child part)``: verticals ``< cut`` / ``>= cut`` (padding trimmed); the slash offsets go
    to the parent iff ``turn_start < cut``. A part without any line is ``None``."""
    valid = _valid(ln.v_idx, ln.v_cnt)
    v_lo, c_lo = _compact(ln.v_idx, valid & (ln.v_idx < cut))
    v_hi, c_hi = _compact(ln.v_idx, valid & (ln.v_idx >= cut))
    empty_s = ln.s_idx[:, :, :0], torch.zeros_like(ln.s_cnt)
    s_par, s_child = ((ln.s_idx, ln.s_cnt), empty_s) if ln.turn_start < cut else (empty_s, (ln.s_idx, ln.s_cnt))
    parts = (TurnLines(ln.turn_start, ln.turn_end, v_lo, c_lo, *s_par),
             TurnLines(ln.turn_start, ln.turn_end, v_hi, c_hi, *s_child))
    return tuple(p if int(p.v_cnt.sum()) + int(p.s_cnt.sum()) else None for p in parts)


def merge_turn_lines(parts: Iterable[TurnLines]) -> TurnLines:
    """One :class:`TurnLines` holding the union of ``parts`` (the parts of one turn, e.g. the parent and child
    parts of a split: the inverse of :func:`split_turn_lines`), verticals and slash offsets deduplicated."""
    parts = list(parts)
    if not parts:
        raise ValueError("merge_turn_lines: parts is empty")
    t0 = parts[0]
    for p in parts[1:]:
        if (p.turn_start, p.turn_end) != (t0.turn_start, t0.turn_end) or p.v_cnt.shape != t0.v_cnt.shape:
            raise ValueError(f"merge_turn_lines: parts of different turns or shapes: turn [{p.turn_start}, "
                             f"{p.turn_end}) {tuple(p.v_cnt.shape)} vs [{t0.turn_start}, {t0.turn_end}) "
                             f"{tuple(t0.v_cnt.shape)}")
    if len(parts) == 1:
        return t0
    v = torch.cat([p.v_idx for p in parts], 2)
    vk = torch.cat([_valid(p.v_idx, p.v_cnt) for p in parts], 2)
    s = torch.cat([p.s_idx for p in parts], 2)
    sk = torch.cat([_valid(p.s_idx, p.s_cnt) for p in parts], 2)
    return TurnLines(t0.turn_start, t0.turn_end, *_compact(v, vk, dedupe=True), *_compact(s, sk, dedupe=True))


class LineStore:
    """Line sets per turn, per layer, per KV head on radix nodes; see the module docstring."""

    def __init__(self, config: LineStoreConfig = LineStoreConfig()):
        self.config = config
        self._entries: dict[Hashable, dict[Hashable, TurnLines]] = {}
        self._lru: OrderedDict[tuple, int] = OrderedDict()  # (node, turn) -> bytes, least recent first
        self._refs: dict[Hashable, int] = {}
        self.bytes = 0
        self.evicted_entries = 0

    # --- reporting -------------------------------------------------------------------------------
    @property
    def num_entries(self) -> int:
        return len(self._lru)

    def refcount(self, node: Hashable) -> int:
        return self._refs.get(node, 0)

    def entries(self, node: Hashable) -> dict:
        """Read-only view: turn id -> :class:`TurnLines` owned by ``node``."""
        return dict(self._entries.get(node, {}))

    # --- mutation ----------------------------------------------------------------------------------
    def _put(self, node, turn, lines: TurnLines) -> None:
        self._entries.setdefault(node, {})[turn] = lines
        self._lru[(node, turn)] = lines.nbytes
        self.bytes += lines.nbytes

    def _drop(self, node, turn) -> None:
        lines = self._entries[node].pop(turn)
        if not self._entries[node]:
            del self._entries[node]
        del self._lru[(node, turn)]
        self.bytes -= lines.nbytes

    def _make_room(self, need: int) -> bool:
        if need > self.config.byte_budget:
            return False
        for node, turn in list(self._lru):
            if self.bytes + need <= self.config.byte_budget:
                break
            if self._refs.get(node, 0) == 0:
                self._drop(node, turn)
                self.evicted_entries += 1
        return self.bytes + need <= self.config.byte_budget

    def attach(self, node: Hashable, turn: Hashable, lines: TurnLines) -> bool:
        """Store ``lines`` of ``turn`` on ``node`` (the node holding the turn's tokens). Returns False
        (nothing stored) when the budget cannot hold it even after evicting unreferenced entries."""
        if turn in self._entries.get(node, {}):
            raise ValueError(f"turn {turn!r} already has lines on node {node!r}")
        if not self._make_room(lines.nbytes):
            return False
        self._put(node, turn, lines)
        return True

    def acquire(self, nodes: Iterable[Hashable]) -> None:
        for n in nodes:
            self._refs[n] = self._refs.get(n, 0) + 1

    def release(self, nodes: Iterable[Hashable]) -> None:
        for n in nodes:
            r = self._refs.get(n, 0)
            if r <= 0:
                raise ValueError(f"release of node {n!r} with refcount {r}")
            if r == 1:
                del self._refs[n]
            else:
                self._refs[n] = r - 1

    def free(self, node: Hashable) -> None:
        """The radix node is gone: drop its entries (it must be unreferenced)."""
        if self._refs.get(node, 0):
            raise ValueError(f"free of node {node!r} with refcount {self._refs[node]}")
        for turn in list(self._entries.get(node, {})):
            self._drop(node, turn)

    def detach(self, node: Hashable) -> dict:
        """Remove and return ``node``'s entries (turn id -> :class:`TurnLines`), e.g. to keep them elsewhere
        while the node leaves the tree (it must be unreferenced, as for :meth:`free`)."""
        if self._refs.get(node, 0):
            raise ValueError(f"detach of node {node!r} with refcount {self._refs[node]}")
        out = self.entries(node)
        for turn in out:
            self._drop(node, turn)
        return out

    def split(self, node: Hashable, new_parent: Hashable, cut: int) -> None:
        """Mirror a radix split of ``node`` at absolute position ``cut`` (see the module docstring).
        Each entry's tensors are partitioned (padding trimmed); the extra count tensors can push
        the total over the budget, which then evicts LRU unreferenced entries and, if that is not
        enough, the parts this split made."""
        if new_parent in self._entries or new_parent in self._refs:
            raise ValueError(f"split: new parent {new_parent!r} already exists in the store")
        if self._refs.get(node):
            self._refs[new_parent] = self._refs[node]
        for turn, ln in list(self._entries.get(node, {}).items()):
            pos_lru = list(self._lru).index((node, turn))
            self._drop(node, turn)
            for owner, part in zip((new_parent, node), split_turn_lines(ln, cut)):
                if part is None:
                    continue
                self._put(owner, turn, part)
                # keep the entry's LRU age: re-insert at its old rank
                key = (owner, turn)
                items = list(self._lru.items())
                items.remove((key, part.nbytes))
                items.insert(min(pos_lru, len(items)), (key, part.nbytes))
                self._lru = OrderedDict(items)
        # the two parts' padding and counts may take a few more bytes than the entry did: evict
        # unreferenced entries, and as a last resort the parts this split made (lines lost, budget kept)
        if not self._make_room(0):
            for owner in (node, new_parent):
                for turn in list(self._entries.get(owner, {})):
                    if self.bytes > self.config.byte_budget:
                        self._drop(owner, turn)
                        self.evicted_entries += 1

    # --- lookup ------------------------------------------------------------------------------------
    def lines_for_path(self, nodes: Iterable[Hashable], complete_to: int | None = None):
        """Union of the lines owned by ``nodes`` (a matched prefix), per (layer, head); marks them used.

        ``complete_to`` (optional): only turns that end at or before this position (turns the prefix
        holds completely, i.e. earlier turns of the same conversation) contribute.
        Returns ``(v_idx, v_cnt, s_idx, s_cnt)`` (``[L, H, W]`` int32 ascending, ``-1``-padded, and
        ``[L, H]`` counts), or None when no node on the path owns lines."""
        parts = []
        for n in nodes:
            for turn, ln in self._entries.get(n, {}).items():
                if complete_to is not None and ln.turn_end > complete_to:
                    continue
                parts.append(ln)
                self._lru.move_to_end((n, turn))
        if not parts:
            return None
        v = torch.cat([p.v_idx for p in parts], 2)
        vk = torch.cat([_valid(p.v_idx, p.v_cnt) for p in parts], 2)
        s = torch.cat([p.s_idx for p in parts], 2)
        sk = torch.cat([_valid(p.s_idx, p.s_cnt) for p in parts], 2)
        v_idx, v_cnt = _compact(v, vk, dedupe=True)
        s_idx, s_cnt = _compact(s, sk, dedupe=True)
        return v_idx, v_cnt, s_idx, s_cnt
