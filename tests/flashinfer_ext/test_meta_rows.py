"""Contract: page size 1's block-metadata rows (:class:`MetaRowAllocator`). A slot holds distinct rows for its
blocks, its table row on the device names them after a flush, a new owner starts fresh, rows come back by release
or reclaim, and a request the free list cannot serve gets nothing (never a row someone else holds)."""

from __future__ import annotations

import pytest
import torch

from flashinfer_ext.psa.meta_rows import TRASH_ROW, MetaRowAllocator


def test_rows_grow_block_by_block_and_the_table_names_them_after_a_flush():
    a = MetaRowAllocator(num_rows=16, num_slots=4, max_blocks_per_req=8)
    assert a.acquire(2, "r1", 3) == (True, True)
    assert a.acquire(2, "r1", 3) == (True, False)  # same owner, nothing new
    assert (a.table_buf == TRASH_ROW).all()  # nothing written before the flush
    a.flush()
    rows = a.rows_of(2)
    assert len(rows) == 3 and len(set(rows)) == 3 and TRASH_ROW not in rows
    assert a.table_buf[2, :3].tolist() == rows and (a.table_buf[2, 3:] == TRASH_ROW).all()
    assert a.acquire(2, "r1", 5) == (True, False)  # the request's context grew by two blocks
    a.flush()
    assert a.table_buf[2, :3].tolist() == rows and len(set(a.table_buf[2, :5].tolist())) == 5
    assert a.used_rows == 5 and a.free_rows == 15 - 5
    table = a.table(torch.tensor([2, 0]), 4)
    assert table.dtype == torch.int32 and table.shape == (2, 4) and table[0].tolist() == a.rows_of(2)[:4]


def test_a_new_owner_of_a_slot_starts_fresh_and_two_slots_never_share_a_row():
    a = MetaRowAllocator(num_rows=10, num_slots=3, max_blocks_per_req=4)
    a.acquire(0, "a", 4)
    a.acquire(1, "b", 4)
    assert not set(a.rows_of(0)) & set(a.rows_of(1))
    ok, fresh = a.acquire(0, "c", 2)  # slot 0 reused by another request: its rows were released first
    assert ok and fresh and len(a.rows_of(0)) == 2 and not set(a.rows_of(0)) & set(a.rows_of(1))
    assert a.owner_of(0) == "c"
    assert a.acquire(1, None, 1) == (True, True)  # an unknown owner never matches


def test_a_short_free_list_refuses_without_handing_out_anything_and_reclaim_frees_dead_slots():
    a = MetaRowAllocator(num_rows=7, num_slots=4, max_blocks_per_req=8)  # 6 usable rows
    assert a.acquire(0, "a", 4)[0] and a.acquire(1, "b", 2)[0] and a.free_rows == 0
    ok, _ = a.acquire(2, "c", 1)
    assert not ok and a.rows_of(2) == [] and a.free_rows == 0
    assert a.reclaim(live_slots={1, 2}) == 4  # slot 0's request is gone
    assert a.acquire(2, "c", 3)[0] and a.rows_of(1) != [] and a.free_rows == 1
    a.release(1)
    a.release(1)  # twice: no double free
    assert a.free_rows == 3 and a.used_rows == 3


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(num_rows=1, num_slots=2, max_blocks_per_req=2), "num_rows=1"),
    (dict(num_rows=4, num_slots=0, max_blocks_per_req=2), "num_slots=0"),
])
def test_bad_sizes_are_refused_naming_the_field(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        MetaRowAllocator(**kwargs)


def test_out_of_range_requests_are_refused():
    a = MetaRowAllocator(num_rows=4, num_slots=2, max_blocks_per_req=2)
    with pytest.raises(ValueError, match="slot=2"):
        a.acquire(2, "x", 1)
    with pytest.raises(ValueError, match="n_blocks=3"):
        a.acquire(0, "x", 3)
