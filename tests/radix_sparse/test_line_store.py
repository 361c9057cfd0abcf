"""LineStore driven by a small pure-python radix tree: thousands of random insert / match / split /
evict operations (fixed seeds) keep the invariants of radix_sparse.line_store's docstring."""

from __future__ import annotations

import random

import pytest
import torch

from radix_sparse import LineStore, LineStoreConfig, TurnLines

L, H = 2, 2  # layers, KV heads


class Node:
    _next = 0

    def __init__(self, key, parent, start):
        Node._next += 1
        self.id = Node._next
        self.key = list(key)       # tokens held by this node
        self.start = start         # absolute position of key[0]
        self.parent = parent
        self.children = {}


class Radix:
    """Minimal radix tree with SGLang's split-on-match; tells the store about splits and frees."""

    def __init__(self, store):
        self.root = Node([], None, 0)
        self.store = store

    def _split(self, node, at):
        """``node`` keeps key[at:]; a new parent takes key[:at] (SGLang's _split_node)."""
        new = Node(node.key[:at], node.parent, node.start)
        new.children = {node.key[at]: node}
        node.parent.children[new.key[0]] = new
        self.store.split(node.id, new.id, node.start + at)
        node.key, node.start, node.parent = node.key[at:], node.start + at, new
        return new

    def match(self, tokens):
        """Path of nodes (root excluded) covering the longest cached prefix; splits at the end."""
        node, path, i = self.root, [], 0
        while i < len(tokens) and tokens[i] in node.children:
            child = node.children[tokens[i]]
            n = 0
            while n < len(child.key) and i + n < len(tokens) and child.key[n] == tokens[i + n]:
                n += 1
            if n < len(child.key):
                child = self._split(child, n)
            path.append(child)
            i += n
            node = child
        return path, i

    def insert(self, tokens):
        """Returns (path, matched_len, new_leaf or None)."""
        path, m = self.match(tokens)
        if m == len(tokens):
            return path, m, None
        parent = path[-1] if path else self.root
        leaf = Node(tokens[m:], parent, m)
        parent.children[tokens[m]] = leaf
        return path + [leaf], m, leaf

    def leaves(self):
        out, stack = [], [self.root]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n is not self.root and not n.children:
                out.append(n)
        return out

    def evict_leaf(self, leaf):
        del leaf.parent.children[leaf.key[0]]
        self.store.free(leaf.id)


def _random_turn(rng, start, end):
    """Verticals anywhere < end (earlier turns too), slash offsets < end, per (layer, head)."""
    v = [[sorted(rng.sample(range(end), rng.randint(0, min(end, 6)))) for _ in range(H)] for _ in range(L)]
    s = [[sorted(rng.sample(range(end), rng.randint(1, min(end, 4)))) for _ in range(H)] for _ in range(L)]

    def pack(rows):
        w = max(1, max(len(r) for lr in rows for r in lr))
        idx = torch.full((L, H, w), -1, dtype=torch.int32)
        cnt = torch.zeros(L, H, dtype=torch.int32)
        for li in range(L):
            for h in range(H):
                idx[li, h, : len(rows[li][h])] = torch.tensor(rows[li][h], dtype=torch.int32)
                cnt[li, h] = len(rows[li][h])
        return idx, cnt

    return TurnLines(start, end, *pack(v), *pack(s)), v, s


def _as_sets(res):
    if res is None:
        return [[(set(), set()) for _ in range(H)] for _ in range(L)]
    v_idx, v_cnt, s_idx, s_cnt = res
    out = []
    for li in range(L):
        row = []
        for h in range(H):
            v = v_idx[li, h, : int(v_cnt[li, h])].tolist()
            s = s_idx[li, h, : int(s_cnt[li, h])].tolist()
            assert v == sorted(set(v)) and s == sorted(set(s)), "union must be ascending and unique"
            row.append((set(v), set(s)))
        out.append(row)
    return out


def _drive(seed, n_ops, budget, check_exact):
    rng = random.Random(seed)
    store = LineStore(LineStoreConfig(byte_budget=budget))
    tree = Radix(store)
    # turn id -> [tokens up to turn_end, start, end, verticals, slashes, limit]; verticals >= limit were
    # on a node the tree evicted (gone for good, even if the same tokens are inserted again later)
    turns = {}
    held = []    # paths acquired by running requests
    vocab = 3    # few tokens: many shared prefixes and splits
    seqs = []
    for op in range(n_ops):
        kind = rng.random()
        if kind < 0.45:  # a request: a new turn (extend a known sequence or start fresh), prefill, insert
            base = list(rng.choice(seqs)) if seqs and rng.random() < 0.7 else []
            tokens = base + [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
            path, m, leaf = tree.insert(tokens)
            seqs.append(tokens)
            if leaf is not None:
                tl, v, s = _random_turn(rng, m, len(tokens))
                if store.attach(leaf.id, op, tl):
                    turns[op] = [tokens, m, len(tokens), v, s, len(tokens)]
            if rng.random() < 0.5:  # the request keeps its path locked (SGLang's inc_lock_ref)
                store.acquire(_up(path[-1]))
                held.append(path[-1])
        elif kind < 0.75 and seqs:  # a match (may split); compare the path's lines with the truth
            tokens = rng.choice(seqs)
            tokens = tokens[: rng.randint(1, len(tokens))]
            path, m = tree.match(tokens)
            got = _as_sets(store.lines_for_path([n.id for n in path]))
            want = [[(set(), set()) for _ in range(H)] for _ in range(L)]
            for tid, (ttoks, ts, te, v, s, limit) in turns.items():
                if m > ts and tokens[: ts + 1] == ttoks[: ts + 1]:  # the prefix reaches the turn's first token
                    shared = next((i for i, (a, b) in enumerate(zip(tokens[:m], ttoks)) if a != b), min(m, len(ttoks)))
                    for li in range(L):
                        for h in range(H):
                            want[li][h][0].update(x for x in v[li][h] if x < min(shared, limit))  # verticals in the shared prefix
                            want[li][h][1].update(s[li][h])
            for li in range(L):
                for h in range(H):
                    if check_exact:
                        assert got[li][h] == want[li][h], (op, li, h)
                    else:  # budget evictions remove lines; never add foreign ones
                        assert got[li][h][0] <= want[li][h][0] and got[li][h][1] <= want[li][h][1], (op, li, h)
        elif kind < 0.85 and held:
            store.release(_up(held.pop(rng.randrange(len(held)))))  # dec_lock_ref walks up, new parents included
        else:  # evict up to 3 unreferenced leaves from the tree
            for leaf in [x for x in tree.leaves() if store.refcount(x.id) == 0][:3]:
                tree.evict_leaf(leaf)
                # tokens behind an evicted leaf are no longer cached: forget those sequences/turns
                seqs = [q for q in seqs if _cached_len(tree, q) == len(q)]
                for x in turns.values():
                    x[5] = min(x[5], _cached_len(tree, x[0]))
                turns = {t: x for t, x in turns.items() if x[5] > x[1]}
        assert store.bytes <= budget
        assert all(store.refcount(i) >= 0 for i in range(Node._next + 1))
        assert store.bytes == sum(ln.nbytes for node in list(store._entries) for ln in store._entries[node].values())
    # teardown: release everything, evict every node: memory returns to zero
    for last in held:
        store.release(_up(last))
    while tree.root.children:
        for leaf in tree.leaves():
            tree.evict_leaf(leaf)
    assert store.bytes == 0 and store.num_entries == 0
    return store


def _up(node):
    """Node ids from ``node`` up to (not including) the root."""
    out = []
    while node.parent is not None:
        out.append(node.id)
        node = node.parent
    return out


def _cached_len(tree, tokens):
    node, i = tree.root, 0
    while i < len(tokens) and tokens[i] in node.children:
        child = node.children[tokens[i]]
        n = 0
        while n < len(child.key) and i + n < len(tokens) and child.key[n] == tokens[i + n]:
            n += 1
        i += n
        if n < len(child.key):
            break
        node = child
    return i


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_operations_exact_union_without_budget_pressure(seed):
    store = _drive(seed, 3000, budget=1 << 40, check_exact=True)
    assert store.evicted_entries == 0


@pytest.mark.parametrize("seed", [3, 4])
def test_random_operations_under_a_tight_budget(seed):
    store = _drive(seed, 3000, budget=3000, check_exact=False)
    assert store.evicted_entries > 0, "the budget never bound: the case does not exercise eviction"


def test_split_moves_verticals_by_position_and_slashes_with_the_turn_start():
    store = LineStore()
    v = torch.tensor([[[2, 9, 15, -1]]], dtype=torch.int32)
    s = torch.tensor([[[0, 3]]], dtype=torch.int32)
    store.attach("n", "t", TurnLines(8, 20, v, torch.tensor([[3]], dtype=torch.int32), s,
                                     torch.tensor([[2]], dtype=torch.int32)))
    before = store.bytes
    store.split("n", "p", 12)
    par, child = store.entries("p")["t"], store.entries("n")["t"]
    assert par.v_idx[0, 0, : int(par.v_cnt[0, 0])].tolist() == [2, 9]
    assert child.v_idx[0, 0, : int(child.v_cnt[0, 0])].tolist() == [15]
    assert int(par.s_cnt[0, 0]) == 2 and int(child.s_cnt[0, 0]) == 0  # turn starts at 8 < 12: parent
    assert store.bytes <= before + 8 and store.num_entries == 2  # + one pair of [L, H] int32 counts
    store.split("p", "pp", 5)  # turn start 8 >= 5: slashes stay with "p"
    assert int(store.entries("p")["t"].s_cnt[0, 0]) == 2 and store.entries("pp")["t"].v_cnt.tolist() == [[1]]


def test_refcounts_guard_free_and_eviction_and_budget_refusal():
    tl = TurnLines(0, 4, torch.zeros(1, 1, 1, dtype=torch.int32), torch.ones(1, 1, dtype=torch.int32),
                   torch.zeros(1, 1, 1, dtype=torch.int32), torch.ones(1, 1, dtype=torch.int32))
    store = LineStore(LineStoreConfig(byte_budget=tl.nbytes))
    assert store.attach("a", 1, tl)
    store.acquire(["a"])
    with pytest.raises(ValueError, match="refcount"):
        store.free("a")
    assert not store.attach("b", 2, tl)  # only entry is referenced: refused, budget kept
    store.release(["a"])
    with pytest.raises(ValueError, match="refcount 0"):
        store.release(["a"])
    assert store.attach("b", 2, tl) and store.entries("a") == {} and store.evicted_entries == 1
    with pytest.raises(ValueError, match="byte_budget"):
        LineStoreConfig(byte_budget=-1)
    with pytest.raises(ValueError, match="turn_start"):
        TurnLines(5, 5, tl.v_idx, tl.v_cnt, tl.s_idx, tl.s_cnt)
