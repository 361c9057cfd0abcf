"""WorkingSetTracker: device-side working sets equal a python reference of the last-w-steps union."""

import random

import pytest
import torch

from radix_sparse.working_set_tracker import WorkingSetTracker


def _reference_sizes(history, window):
    """history: key -> list of per-step sets of (layer, head, block)."""
    return {k: len(set().union(*steps[-window:])) if steps else None for k, steps in history.items()}


@pytest.mark.parametrize("layers,heads,max_blocks,window,slots", [(2, 1, 5, 3, 4), (3, 2, 17, 12, 3), (1, 4, 64, 1, 8)])
def test_sizes_equal_union_of_last_window_steps(layers, heads, max_blocks, window, slots):
    rng = random.Random(layers * 100 + heads * 10 + window)
    tr = WorkingSetTracker(num_slots=slots, num_layers=layers, num_kv_heads=heads, max_blocks=max_blocks,
                           window=window, max_batch_size=6)
    history = {}
    live = []
    next_key = 0
    for step in range(40):
        # requests come and go (absent from a decode batch = finished)
        live = [k for k in live if rng.random() > 0.1]
        while len(live) < rng.randint(1, 6):
            live.append(next_key)
            history[next_key] = []
            next_key += 1
        slot_list = tr.assign(live)
        cols = rng.randint(1, max_blocks)
        tr.plan_rows(slot_list, cols)
        tr.begin_step()
        bs = len(live)
        step_sets = {k: set() for k in live}
        for layer in range(layers):
            order = torch.stack([torch.stack([torch.randperm(cols) for _ in range(heads)]) for _ in range(bs)])
            nread = torch.randint(0, cols + 1, (bs, heads), dtype=torch.int32)
            tr.record(layer, order, nread)
            for b, k in enumerate(live):
                for h in range(heads):
                    step_sets[k] |= {(layer, h, int(c)) for c in order[b, h, : int(nread[b, h])]}
        for k in live:
            if tr.tracked.get(k) is not None:
                history[k].append(step_sets[k])
        got = tr.sizes(live)
        ref = _reference_sizes({k: history[k] for k in live}, window)
        for k, g in zip(live, got):
            if k in tr.tracked:
                assert g == ref[k], (step, k)
            else:
                assert g is None  # no free slot: untracked, the caller counts the whole context


def test_slots_are_reset_for_a_new_request_and_released_for_absent_ones():
    tr = WorkingSetTracker(num_slots=1, num_layers=1, num_kv_heads=1, max_blocks=4, window=4, max_batch_size=2)
    s = tr.assign(["a", "b"])
    assert s[0] == 0 and s[1] == tr.trash  # one slot: the second request is untracked
    tr.plan_rows(s, 4)
    tr.begin_step()
    tr.record(0, torch.tensor([[[3, 2, 1, 0]], [[0, 1, 2, 3]]]), torch.tensor([[4], [4]]))
    assert tr.sizes(["a", "b"]) == [4, None]
    s = tr.assign(["b"])  # "a" finished: its slot goes to "b", reset
    assert s == [0] and tr.sizes(["b"]) == [None]
    tr.plan_rows(s, 4)
    tr.begin_step()
    tr.record(0, torch.tensor([[[1, 0, 2, 3]]]), torch.tensor([[1]]))
    assert tr.sizes(["b"]) == [1]


def test_record_rows_matches_record_for_the_same_rows():
    a = WorkingSetTracker(num_slots=4, num_layers=2, num_kv_heads=2, max_blocks=8, window=2, max_batch_size=4)
    b = WorkingSetTracker(num_slots=4, num_layers=2, num_kv_heads=2, max_blocks=8, window=2, max_batch_size=4)
    keys = ["x", "y", "z"]
    for tr in (a, b):
        tr.plan_rows(tr.assign(keys), 8)
    for step in range(5):
        g = torch.Generator().manual_seed(step)
        order = torch.stack([torch.stack([torch.randperm(8, generator=g) for _ in range(2)]) for _ in range(3)])
        nread = torch.randint(0, 9, (3, 2), generator=g)
        for tr in (a, b):
            tr.begin_step()
        for layer in range(2):
            a.record(layer, order, nread)
            b.record_rows(layer, torch.arange(3), order, nread)
        assert a.sizes(keys) == b.sizes(keys)
        assert torch.equal(a.stamp_buf, b.stamp_buf)


@pytest.mark.parametrize("field,kwargs", [("window", dict(window=0)), ("num_slots", dict(num_slots=-1)),
                                          ("max_blocks", dict(max_blocks=1.5))])
def test_bad_sizes_name_the_field(field, kwargs):
    base = dict(num_slots=2, num_layers=1, num_kv_heads=1, max_blocks=4, window=3, max_batch_size=2)
    with pytest.raises(ValueError, match=field):
        WorkingSetTracker(**{**base, **kwargs})
