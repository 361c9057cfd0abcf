"""radix_sparse.host_lines: LoopServe line sets of host-resident radix nodes (pure torch): moved to the CPU with
positions unchanged, byte-accounted and bounded, dropped with their host entry, rebuilt for a reloaded node by
the radix split rule (exact range, a load stopping inside a saved range, several saved ranges merged)."""

from __future__ import annotations

import pytest
import torch

from radix_sparse.host_lines import HostLineConfig, HostLineStore, NodeLines, partition_lines, restore_lines
from radix_sparse.host_nodes import HostNodeStore
from radix_sparse.host_pool import HostBlockPool, HostTierConfig, KVShape
from radix_sparse.line_store import LineStore, TurnLines

I32 = torch.int32


def _turn(start, end, verts, slashes) -> TurnLines:
    """One layer, one head."""
    w = max(len(verts), 1)
    v = torch.full((1, 1, w), -1, dtype=I32)
    v[0, 0, : len(verts)] = torch.tensor(verts, dtype=I32)
    s = torch.tensor([[slashes]], dtype=I32).reshape(1, 1, len(slashes))
    return TurnLines(start, end, v, torch.tensor([[len(verts)]], dtype=I32), s,
                     torch.tensor([[len(slashes)]], dtype=I32))


def _verts(ln: TurnLines) -> list:
    return ln.v_idx[0, 0, : int(ln.v_cnt[0, 0])].tolist()


def _slashes(ln: TurnLines) -> list:
    return ln.s_idx[0, 0, : int(ln.s_cnt[0, 0])].tolist()


def test_node_lines_validate_and_name_the_field():
    t = _turn(0, 10, [1, 5], [0])
    with pytest.raises(ValueError, match="NodeLines.start=4, NodeLines.end=4"):
        NodeLines(4, 4, (("t", t),))
    with pytest.raises(ValueError, match="NodeLines.turns must be a non-empty tuple"):
        NodeLines(0, 4, [("t", t)])
    with pytest.raises(ValueError, match="NodeLines.turns: a turn id appears twice"):
        NodeLines(0, 4, (("t", t), ("t", t)))
    with pytest.raises(ValueError, match="NodeLines.turns: expected"):
        NodeLines(0, 4, (("t", "not lines"),))
    with pytest.raises(ValueError, match="HostLineConfig.byte_budget"):
        HostLineConfig(byte_budget=-1)


def test_put_moves_to_cpu_keeps_positions_and_accounts_bytes():
    a = NodeLines(0, 16, (("t1", _turn(0, 16, [2, 9, 15], [0, 3])), ("t2", _turn(8, 16, [3, 12], []))))
    store = HostLineStore(HostLineConfig(byte_budget=1 << 20))
    assert store.put("k", a)
    got = store.get("k")
    assert store.bytes == a.nbytes > 0 and store.num_turns == 2 and len(store) == 1
    assert all(ln.v_idx.device.type == "cpu" for _, ln in got.turns)
    assert [(t, _verts(ln), _slashes(ln)) for t, ln in got.turns] == \
        [("t1", [2, 9, 15], [0, 3]), ("t2", [3, 12], [])]
    # replacing the entry's lines does not double-count
    assert store.put("k", NodeLines(0, 16, (("t1", _turn(0, 16, [2], [])),)))
    assert store.num_turns == 1 and store.bytes == store.get("k").nbytes < a.nbytes
    store.drop("k")
    assert store.bytes == 0 and len(store) == 0 and store.dropped_turns == 1
    store.drop("k")  # no lines: no-op


def test_budget_evicts_least_recently_used_lines_and_refuses_what_cannot_fit():
    one = NodeLines(0, 4, (("t", _turn(0, 4, [1, 2], [0])),))
    store = HostLineStore(HostLineConfig(byte_budget=2 * one.nbytes))
    assert store.put("a", one) and store.put("b", one)
    store.get("a")                               # a is now the most recently used
    assert store.put("c", one)                   # b goes
    assert "b" not in store and "a" in store and "c" in store and store.evicted_turns == 1
    assert store.bytes <= store.config.byte_budget
    big = NodeLines(0, 4, (("t", _turn(0, 4, list(range(64)), [0])),))
    assert not store.put("d", big) and "d" not in store and store.refused_turns == 1
    assert not HostLineStore(HostLineConfig(byte_budget=0)).put("a", one)


def test_lines_are_dropped_with_their_host_entry():
    shape = KVShape(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32)
    block = 1 * 1 * 2 * 2 * 4 * 4
    nodes = HostNodeStore(HostBlockPool(HostTierConfig(host_tier_gb=2 * block / 2**30, gpu_cache_blocks=8,
                                                       page_size=2), shape))
    lines = HostLineStore()
    nodes.drop_listeners.append(lambda e: lines.drop(e.key))
    a = nodes.add(None, [], 0, [1, 1, 1, 1], nodes.reserve(2))
    lines.put(a.key, NodeLines(0, 4, (("t", _turn(0, 4, [1, 3], [0])),)))
    assert lines.bytes > 0
    nodes.add(None, [], 0, [2, 2, 2, 2], nodes.reserve(2))   # the pool holds one entry: a is dropped (LRU)
    assert nodes.dropped == 1 and a.key not in lines and lines.bytes == 0 and lines.dropped_turns == 1
    b = next(iter(nodes._entries.values()))
    lines.put(b.key, NodeLines(0, 4, (("t", _turn(0, 4, [1], [])),)))
    nodes.clear()
    assert lines.bytes == 0 and len(lines) == 0


def test_restore_exact_range_gives_the_saved_lines():
    saved = NodeLines(8, 24, (("t", _turn(8, 24, [0, 3, 9, 20], [0, 5])),))
    got = restore_lines([(saved, 24)], 8, 24)
    assert got.start == 8 and got.end == 24
    assert [(t, _verts(ln), _slashes(ln)) for t, ln in got.turns] == [("t", [0, 3, 9, 20], [0, 5])]


def test_restore_stopping_inside_a_saved_range_keeps_the_split_rule_part():
    saved = NodeLines(8, 24, (("t", _turn(8, 24, [0, 3, 9, 20], [0, 5])), ("u", _turn(16, 24, [17, 18], [1]))))
    got = restore_lines([(saved, 12)], 8, 12)          # a load of [8, 12) only
    assert [(t, _verts(ln), _slashes(ln)) for t, ln in got.turns] == [("t", [0, 3, 9], [0, 5])]
    # and it is what LineStore.split gives the new parent at the same cut
    ls = LineStore()
    for t, ln in saved.turns:
        ls.attach("n", t, ln)
    ls.split("n", "p", 12)
    assert {t: (_verts(ln), _slashes(ln)) for t, ln in ls.entries("p").items()} == \
        {t: (_verts(ln), _slashes(ln)) for t, ln in got.turns}
    assert restore_lines([(NodeLines(8, 24, (("u", _turn(16, 24, [17], [1])),)), 12)], 8, 12) is None


def test_restore_of_several_saved_ranges_merges_the_parts_of_a_turn_and_partition_inverts_it():
    # a turn starting at 4 whose node was split at 10 (parent [0, 10), child [10, 20)) before both were evicted
    ls = LineStore()
    ls.attach("n", "t", _turn(4, 20, [1, 6, 12, 19], [0, 2]))
    ls.split("n", "p", 10)
    parent = NodeLines(0, 10, tuple(ls.entries("p").items()))
    child = NodeLines(10, 20, tuple(ls.entries("n").items()) + (("v", _turn(12, 20, [13], [0])),))
    got = restore_lines([(child, 20), (parent, 10)], 0, 20)   # reloaded as one node [0, 20)
    by = {t: (_verts(ln), _slashes(ln)) for t, ln in got.turns}
    assert by == {"t": ([1, 6, 12, 19], [0, 2]), "v": ([13], [0])}
    parts = partition_lines(got, [0, 10, 20])                  # evicted again over the two entries
    assert [{t: (_verts(ln), _slashes(ln)) for t, ln in p.turns} for p in parts] == \
        [{"t": ([1, 6], [0, 2])}, {"t": ([12, 19], []), "v": ([13], [0])}]
    with pytest.raises(ValueError, match="does not fit"):
        restore_lines([(parent, 10), (child, 20)], 2, 20)
    with pytest.raises(ValueError, match="bounds"):
        partition_lines(got, [0, 25])
