"""Contract: LoopServe's decode wrapper (flashinfer_ext.loopserve.decode.VerticalSlashDecode) plans once per step and
runs per layer with tensors only: its kernel path (split or one program per pair) equals the free kernel functions
called with the same lists bit for bit, its reference path equals the masked fp32 reference, eager buffers grow
to the largest step and fixed (graph) buffers refuse a larger one."""

from __future__ import annotations

import pytest
import torch

from flashinfer_ext.common.sparse_decode import lists_to_mask, sparse_decode
from flashinfer_ext.common.split_decode import plan_splits, sparse_decode_split
from flashinfer_ext.loopserve.decode import VerticalSlashDecode
from flashinfer_ext.loopserve.reference import masked_decode_reference

from .kv_pool import make_pool

HQ, HK, D = 4, 2, 64


def _lists(seq_lens, width, seed=0):
    g = torch.Generator().manual_seed(seed)
    lists = torch.full((len(seq_lens), HK, width), -1, dtype=torch.int32)
    lens = torch.zeros(len(seq_lens), HK, dtype=torch.int32)
    for b, n in enumerate(seq_lens):
        for h in range(HK):
            k = min(width, n)
            lists[b, h, :k] = torch.randperm(n, generator=g)[:k].sort().values.to(torch.int32)
            lens[b, h] = k
    return lists, lens


@pytest.mark.parametrize("target_programs", [1, 64], ids=["one_span", "split"])
def test_kernel_path_equals_the_free_functions(target_programs):
    seq_lens = [300, 90, 140]
    pool = make_pool(seq_lens, HQ, HK, D, torch.float32, 1, seed=3)
    q = torch.randn(len(seq_lens), HQ, D, generator=torch.Generator().manual_seed(4))
    lists, lens = _lists(seq_lens, 80)
    seq = torch.tensor(seq_lens)
    vsd = VerticalSlashDecode(HQ, HK, D, torch.device("cpu"), use_kernels=True)
    plan = vsd.plan(pool.req_pool_indices, seq, max_len=max(seq_lens), list_width=80, target_programs=target_programs)
    got = vsd.run(plan, q, pool.k_buffer, pool.v_buffer, pool.req_to_token, lists, lens, D ** -0.5)
    seq32 = seq.to(torch.int32)
    split = plan_splits(80, len(seq_lens) * HK, block_size=1, target_programs=target_programs)
    assert plan.split == split
    if split.num_splits > 1:
        want, _, _ = sparse_decode_split(q, pool.k_buffer, pool.v_buffer, pool.req_to_token, pool.req_pool_indices,
                                         seq32, lists, lens, split, block_size=1, sm_scale=D ** -0.5)
    else:
        want, _, _ = sparse_decode(q, pool.k_buffer, pool.v_buffer, pool.req_to_token, pool.req_pool_indices, seq32,
                                   lists, lens, torch.zeros(len(seq_lens), dtype=torch.int32), block_size=1,
                                   sm_scale=D ** -0.5, epsilon=1.0)
    assert torch.equal(got, want)


def test_reference_path_equals_the_masked_reference_and_eager_buffers_grow():
    vsd = VerticalSlashDecode(HQ, HK, D, torch.device("cpu"), use_kernels=False)
    for seq_lens in ([120, 40], [300, 90, 140]):
        pool = make_pool(seq_lens, HQ, HK, D, torch.float32, 1, seed=len(seq_lens))
        q = torch.randn(len(seq_lens), HQ, D, generator=torch.Generator().manual_seed(1))
        lists, lens = _lists(seq_lens, 32)
        plan = vsd.plan(pool.req_pool_indices, torch.tensor(seq_lens), max_len=max(seq_lens), list_width=32,
                        target_programs=8)
        assert plan.split is None and plan.seq_lens.tolist() == seq_lens
        got = vsd.run(plan, q, pool.k_buffer, pool.v_buffer, pool.req_to_token, lists, lens, D ** -0.5)
        want = masked_decode_reference(q, pool.k_buffer, pool.v_buffer, pool.req_to_token, pool.req_pool_indices,
                                       lists_to_mask(lists, lens, max(seq_lens)), D ** -0.5)
        assert torch.equal(got, want)


def test_fixed_buffers_refuse_a_larger_plan():
    vsd = VerticalSlashDecode(HQ, HK, D, torch.device("cpu"), use_kernels=True, list_width=256, max_batch=2,
                              target_programs=8)
    rpi = torch.zeros(2, dtype=torch.int64)
    plan = vsd.plan(rpi, None, max_len=1, list_width=256, target_programs=8)
    assert plan.seq_lens.tolist() == [1, 1]  # a capture keeps the fixed lengths (ones)
    with pytest.raises(RuntimeError, match="exceeds the fixed buffers"):
        vsd.plan(torch.zeros(3, dtype=torch.int64), None, max_len=1, list_width=256, target_programs=8)


def test_batch_invariant_plan_splits_every_batch_as_one_row_and_always_merges():
    """Default plans shorten the spans as the batch grows (about two waves of programs); the batch-invariant plan
    is the one-row plan at every batch size, and keeps the split + merge path even where one span covers the lists
    (the one-program kernel would round differently)."""
    rpi = torch.zeros(8, dtype=torch.int64)
    seq = torch.full((8,), 5000)
    default = VerticalSlashDecode(HQ, HK, D, torch.device("cpu"), use_kernels=True)
    inv = VerticalSlashDecode(HQ, HK, D, torch.device("cpu"), use_kernels=True, batch_invariant=True)
    plans = {n: (default.plan(rpi[:n], seq[:n], max_len=5000, list_width=4096, target_programs=64).split,
                 inv.plan(rpi[:n], seq[:n], max_len=5000, list_width=4096, target_programs=64).split) for n in (1, 8)}
    assert plans[1][0] != plans[8][0]  # what batch invariance removes
    assert plans[1][1] == plans[8][1] == plans[1][0]
    one = inv.plan(rpi[:2], seq[:2], max_len=300, list_width=256, target_programs=1)
    assert one.split.num_splits == 1 and one.partial_o is not None


@pytest.mark.parametrize("target_programs,batch_invariant", [
    (1, True), (64, True),
    pytest.param(64, False, marks=pytest.mark.xfail(
        strict=True, reason="the default plan shortens the spans for the batch of 3: other fp32 rounding"))],
    ids=["one_span", "split", "split_default"])
def test_batch_invariant_decode_of_a_row_is_bitwise_the_same_alone_and_in_a_batch(target_programs, batch_invariant):
    """A row decoded alone and beside two rows with longer lists: bitwise equal outputs with ``batch_invariant``."""
    seq_lens = [2400, 3000, 2600]
    pool = make_pool(seq_lens, HQ, HK, D, torch.float32, 1, seed=5)
    q = torch.randn(len(seq_lens), HQ, D, generator=torch.Generator().manual_seed(6))
    lists, lens = _lists(seq_lens, 2000, seed=7)
    lens[0] = 1500
    seq = torch.tensor(seq_lens)
    outs = []
    for n in (1, 3):
        vsd = VerticalSlashDecode(HQ, HK, D, torch.device("cpu"), use_kernels=True, batch_invariant=batch_invariant)
        plan = vsd.plan(pool.req_pool_indices[:n], seq[:n], max_len=max(seq_lens[:n]),
                        list_width=int(lens[:n].max()), target_programs=target_programs)
        outs.append(vsd.run(plan, q[:n], pool.k_buffer, pool.v_buffer, pool.req_to_token, lists[:n], lens[:n],
                            D ** -0.5))
    assert torch.equal(outs[0][0], outs[1][0])
    want = masked_decode_reference(q, pool.k_buffer, pool.v_buffer, pool.req_to_token, pool.req_pool_indices,
                                   lists_to_mask(lists, lens, max(seq_lens)), D ** -0.5)
    torch.testing.assert_close(outs[1], want, rtol=1e-5, atol=1e-5)
