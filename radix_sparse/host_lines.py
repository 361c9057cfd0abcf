"""LoopServe line sets of radix nodes that live in the host tier (pure torch/python, no sglang import).

When the host tier saves an evicted radix node (:class:`radix_sparse.host_nodes.HostNode`), the line
entries the node owned in the :class:`~radix_sparse.line_store.LineStore` (every turn stored on it) go
with it: a :class:`NodeLines` (the node's absolute token range + its ``(turn id, TurnLines)`` entries,
tensors on the CPU) kept in a :class:`HostLineStore` under the host entry's key. When the entry is loaded
back, :func:`restore_lines` rebuilds the entries of the node that now holds the reloaded tokens, and they are
attached to it again (device tensors).

Positions: vertical lines are absolute key positions and slash offsets are relative; both are kept as
they are (a host entry is addressed by its token path, so the same positions mean the same tokens).
Where the reloaded node's boundaries differ from the saved node's, the mapping is the radix split rule of
:mod:`radix_sparse.line_store` (:func:`~radix_sparse.line_store.split_turn_lines`): a node that ends at
``cut`` inside a saved range owns that range's verticals ``< cut`` and its slash offsets iff the turn
starts before ``cut``; a node spanning several saved ranges owns the union of their entries, per turn
(:func:`~radix_sparse.line_store.merge_turn_lines`, the inverse of a split). :func:`partition_lines` is the
other direction (a node spanning several host entries, split at their boundaries).

Bound: :class:`HostLineStore` holds at most ``byte_budget`` bytes of line tensors; a ``put`` that does not
fit drops the line sets of the least recently used host entries first (the entries' KV stays) and is
refused when the budget cannot hold it at all. Line sets leave with their host entry
(:meth:`HostLineStore.drop`, wired to :attr:`HostNodeStore.drop_listeners`). Not thread-safe (the
scheduler thread owns it).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable, Sequence

from radix_sparse.line_store import TurnLines, merge_turn_lines, split_turn_lines

__all__ = ["NodeLines", "HostLineConfig", "HostLineStore", "restore_lines", "partition_lines"]


def _int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{name}={v!r} is not an integer")
    return v


@dataclass(frozen=True)
class NodeLines:
    """The line entries one radix node owned: its absolute token range ``[start, end)`` and ``turns``, a
    tuple of ``(turn id, TurnLines)`` pairs (distinct turn ids)."""

    start: int
    end: int
    turns: tuple

    def __post_init__(self) -> None:
        if not 0 <= _int("NodeLines.start", self.start) < _int("NodeLines.end", self.end):
            raise ValueError(f"NodeLines.start={self.start}, NodeLines.end={self.end}: expected 0 <= start < end")
        if not isinstance(self.turns, tuple) or not self.turns:
            n = len(self.turns) if hasattr(self.turns, "__len__") else "?"
            raise ValueError(f"NodeLines.turns must be a non-empty tuple of (turn id, TurnLines), got "
                             f"{type(self.turns).__name__} of {n}")
        for item in self.turns:
            if not isinstance(item, tuple) or len(item) != 2 or not isinstance(item[1], TurnLines):
                raise ValueError(f"NodeLines.turns: expected (turn id, TurnLines) pairs, got {item!r:.80}")
        ids = [t for t, _ in self.turns]
        if len(set(ids)) != len(ids):
            raise ValueError(f"NodeLines.turns: a turn id appears twice in {ids!r:.200}")

    @property
    def nbytes(self) -> int:
        return sum(ln.nbytes for _, ln in self.turns)

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    def to(self, device) -> "NodeLines":
        """The same lines with every tensor on ``device``."""
        return NodeLines(self.start, self.end, tuple(
            (t, TurnLines(ln.turn_start, ln.turn_end, ln.v_idx.to(device), ln.v_cnt.to(device), ln.s_idx.to(device),
                          ln.s_cnt.to(device))) for t, ln in self.turns))

    def head(self, cut: int) -> "NodeLines | None":
        """What a node holding ``[start, cut)`` of this range owns (the parent part of a split at ``cut``);
        ``None`` when that is no line at all."""
        if not self.start < _int("cut", cut) <= self.end:
            raise ValueError(f"NodeLines.head: cut={cut} outside ({self.start}, {self.end}]")
        if cut == self.end:
            return self
        turns = tuple((t, lo) for t, lo in ((t, split_turn_lines(ln, cut)[0]) for t, ln in self.turns)
                      if lo is not None)
        return NodeLines(self.start, cut, turns) if turns else None


def restore_lines(parts: Sequence[tuple[NodeLines, int]], start: int, end: int) -> NodeLines | None:
    """Entries of a node holding ``[start, end)`` rebuilt from saved ``(NodeLines, used_end)`` parts, each
    used over ``[lines.start, used_end)`` (a reload that stops inside a saved range uses its head, see the
    module docstring); every used range must lie in ``[start, end)`` and the ranges must not overlap. Turns
    found in several parts are merged. ``None`` when nothing is left."""
    if not 0 <= _int("start", start) < _int("end", end):
        raise ValueError(f"restore_lines: start={start}, end={end}: expected 0 <= start < end")
    by_turn: dict[Hashable, list] = {}
    prev = start
    for lines, used_end in sorted(parts, key=lambda p: p[0].start):
        if not (prev <= lines.start < _int("used_end", used_end) <= end and used_end <= lines.end):
            raise ValueError(f"restore_lines: part [{lines.start}, {lines.end}) used to {used_end} does not fit "
                             f"[{prev}, {end}) of the node [{start}, {end})")
        prev = used_end
        head = lines.head(used_end)
        for t, ln in head.turns if head is not None else ():
            by_turn.setdefault(t, []).append(ln)
    if not by_turn:
        return None
    return NodeLines(start, end, tuple((t, merge_turn_lines(lns)) for t, lns in by_turn.items()))


def partition_lines(lines: NodeLines, bounds: Sequence[int]) -> list[NodeLines | None]:
    """Split ``lines`` of a node at the ascending ``bounds`` ``[b0 = start, b1, ..., bk <= end]`` into the
    parts owned by ranges ``[b_i, b_{i+1})`` (repeated radix splits; the last part keeps everything from
    ``b_{k-1}``, including verticals at or after ``bk``). ``None`` for a range that owns no line."""
    b = [_int("bounds[i]", x) for x in bounds]
    if len(b) < 2 or b[0] != lines.start or any(x >= y for x, y in zip(b, b[1:])) or b[-1] > lines.end:
        raise ValueError(f"partition_lines: bounds={b!r:.200} must ascend from start={lines.start} to at most "
                         f"end={lines.end}")
    out: list[NodeLines | None] = []
    rest = dict(lines.turns)
    for lo, hi in zip(b[:-1], b[1:]):
        if hi == b[-1]:
            out.append(NodeLines(lo, hi, tuple(rest.items())) if rest else None)
            break
        head, tail = {}, {}
        for t, ln in rest.items():
            p, c = split_turn_lines(ln, hi)
            if p is not None:
                head[t] = p
            if c is not None:
                tail[t] = c
        out.append(NodeLines(lo, hi, tuple(head.items())) if head else None)
        rest = tail
    return out


@dataclass(frozen=True)
class HostLineConfig:
    """Memory bound of the host-resident line sets."""

    byte_budget: int = 256 << 20
    """bytes of line tensors kept with host entries, at most (>= 0; 0 keeps none)."""

    def __post_init__(self) -> None:
        if isinstance(self.byte_budget, bool) or not isinstance(self.byte_budget, int) \
                or not 0 <= self.byte_budget <= 1 << 50:
            raise ValueError(f"HostLineConfig.byte_budget={self.byte_budget!r} is out of range: "
                             f"expected an integer in [0, {1 << 50}]")


class HostLineStore:
    """:class:`NodeLines` (CPU tensors) of host entries, by entry key; LRU by use, ``bytes <= byte_budget``."""

    def __init__(self, config: HostLineConfig = HostLineConfig()) -> None:
        self.config = config
        self._lines: "OrderedDict[Hashable, NodeLines]" = OrderedDict()
        self.bytes = 0
        self.stored_turns = 0      # turns put (moved to the host)
        self.refused_turns = 0     # turns that could not fit the budget at all
        self.evicted_turns = 0     # turns dropped to make room (their entries' KV stays)
        self.dropped_turns = 0     # turns dropped with their host entry

    def __len__(self) -> int:
        return len(self._lines)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._lines

    @property
    def num_turns(self) -> int:
        return sum(v.num_turns for v in self._lines.values())

    def _remove(self, key: Hashable) -> NodeLines:
        v = self._lines.pop(key)
        self.bytes -= v.nbytes
        return v

    def put(self, key: Hashable, lines: NodeLines) -> bool:
        """Keep ``lines`` (moved to the CPU) for host entry ``key``, replacing what it had. Returns False
        (nothing kept for ``key``) when they exceed the whole budget."""
        if not isinstance(lines, NodeLines):
            raise ValueError(f"HostLineStore.put: lines must be NodeLines, got {type(lines).__name__}")
        if key in self._lines:
            self._remove(key)
        need = lines.nbytes
        if need > self.config.byte_budget:
            self.refused_turns += lines.num_turns
            return False
        while self.bytes + need > self.config.byte_budget:
            self.evicted_turns += self._remove(next(iter(self._lines))).num_turns
        host = lines.to("cpu")
        self._lines[key] = host
        self.bytes += host.nbytes
        self.stored_turns += host.num_turns
        return True

    def get(self, key: Hashable) -> NodeLines | None:
        """The lines kept for ``key`` (refreshes its LRU rank), or None."""
        v = self._lines.get(key)
        if v is not None:
            self._lines.move_to_end(key)
        return v

    def drop(self, key: Hashable) -> None:
        """The host entry ``key`` is gone: its lines go too (no-op when it had none)."""
        if key in self._lines:
            self.dropped_turns += self._remove(key).num_turns

    def clear(self) -> None:
        self._lines.clear()
        self.bytes = 0
