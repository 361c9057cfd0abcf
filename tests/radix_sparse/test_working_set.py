"""admit (SparseServe Alg. 1): order kept, nothing dropped, capacity respected, progress guaranteed."""

from __future__ import annotations

import random

import pytest
import torch

from radix_sparse.working_set import admit


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
