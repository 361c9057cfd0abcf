"""WorkingSetEstimator (union of the last w step selections) and admit (SparseServe Alg. 1)."""

from __future__ import annotations

import random

import pytest
import torch

from radix_sparse.working_set import WorkingSetEstimator, admit


def _rows(*sels, width=6):
    out = torch.full((len(sels), width), -1, dtype=torch.int64)
    for i, s in enumerate(sels):
        out[i, :len(s)] = torch.tensor(s, dtype=torch.int64)
    return out


def test_union_over_window_ages_out_old_steps():
    est = WorkingSetEstimator(window=3, max_requests=4, max_selected=6)
    r = torch.tensor([1, 2])
    est.record(r, _rows([1, 2, 3], [7]))
    est.record(r, _rows([3, 4], [7, 7, 8]))       # duplicates within and across steps count once
    assert est.sizes(r).tolist() == [4, 2]
    est.record(r, _rows([], [9]))
    assert est.sizes(r).tolist() == [4, 3]
    est.record(r, _rows([5], []))                 # step 1 ages out: {3,4} u {} u {5}
    assert est.sizes(r).tolist() == [3, 3] and est.union(1).tolist() == [3, 4, 5]
    assert est.union(2).tolist() == [7, 8, 9]
    est.record(r[:1], _rows([6]))                 # only request 1 steps
    assert est.sizes(r).tolist() == [2, 3] and est.union(1).tolist() == [5, 6]
    est.reset(r[:1])
    assert est.sizes(torch.tensor([1, 2, 0])).tolist() == [0, 3, 0]


def test_record_validates_shapes():
    est = WorkingSetEstimator(window=2, max_requests=2, max_selected=3)
    with pytest.raises(ValueError, match="max_selected=3"):
        est.record(torch.tensor([0]), torch.zeros(1, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="req_slots"):
        est.record(torch.tensor([0.0]), torch.zeros(1, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"< 2\*\*31"):
        est.record(torch.tensor([0]), torch.tensor([[2**31]]))
    with pytest.raises(ValueError, match=r"window=0 .*\[1, 256\]"):
        WorkingSetEstimator(window=0)


@pytest.mark.parametrize("seed", [0, 1])
def test_random_steps_match_python_sets(seed):
    rng = random.Random(seed)
    w, R, S = 12, 8, 20
    est = WorkingSetEstimator(window=w, max_requests=R, max_selected=S)
    hist: dict[int, list[set[int]]] = {r: [] for r in range(R)}
    for _ in range(400):
        if rng.random() < 0.05:
            gone = rng.sample(range(R), rng.randint(1, 3))
            est.reset(torch.tensor(gone))
            for r in gone:
                hist[r] = []
        batch = rng.sample(range(R), rng.randint(1, R))
        sels = [[rng.randrange(60) for _ in range(rng.randint(0, S))] for _ in batch]
        est.record(torch.tensor(batch), _rows(*sels, width=S))
        for r, s in zip(batch, sels):
            hist[r] = (hist[r] + [set(s)])[-w:]
        q = list(range(R))
        want = [len(set().union(*hist[r])) for r in q]
        assert est.sizes(torch.tensor(q)).tolist() == want
        r0 = rng.randrange(R)
        assert est.union(r0).tolist() == sorted(set().union(*hist[r0]))


def test_admit_follows_alg1_keeps_order_never_drops():
    a = admit([4, 5, 2, 3], capacity=9)
    assert a.admitted == (0, 1) and a.queued == (2, 3) and a.used == 9 and not a.oversize
    a = admit([4, 6, 2, 3], capacity=9)            # 6 does not fit, later 2 and 3 do (Alg. 1 scans on)
    assert a.admitted == (0, 2, 3) and a.queued == (1,) and a.used == 9
    a = admit([4, 6, 2, 3], capacity=9, stop_at_first_miss=True)
    assert a.admitted == (0,) and a.queued == (1, 2, 3)
    a = admit(torch.tensor([20, 1]), capacity=9)   # first does not fit, second does
    assert a.admitted == (1,) and a.queued == (0,)
    a = admit([20, 30], capacity=9)                # nothing fits: the first runs alone
    assert a.admitted == (0,) and a.queued == (1,) and a.oversize and a.used == 20
    assert admit([], capacity=3).admitted == ()
    with pytest.raises(ValueError, match="capacity"):
        admit([1], capacity=-1)
    with pytest.raises(ValueError, match="non-negative"):
        admit([1.5], capacity=3)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_admit_random_partition_and_capacity(seed):
    rng = random.Random(seed)
    for _ in range(2000):
        sizes = [rng.randint(0, 20) for _ in range(rng.randint(0, 12))]
        cap = rng.randint(0, 60)
        strict = rng.random() < 0.5
        a = admit(sizes, cap, stop_at_first_miss=strict)
        assert sorted(a.admitted + a.queued) == list(range(len(sizes)))  # never drops
        assert list(a.admitted) == sorted(a.admitted) and list(a.queued) == sorted(a.queued)
        assert a.used == sum(sizes[i] for i in a.admitted)
        if a.oversize:
            assert a.admitted == (0,) and all(s > cap for s in sizes[:1])
        else:
            assert a.used <= cap
            assert sizes == [] or a.admitted  # something runs whenever there is a candidate
            # greedy maximality: every queued request would have overflowed when it was considered
            for q in a.queued:
                before = sum(sizes[i] for i in a.admitted if i < q)
                assert before + sizes[q] > cap or (strict and any(j < q for j in a.queued if j != q))
