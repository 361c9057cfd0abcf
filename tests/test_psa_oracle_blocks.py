"""Contract: the oracle order of ``bench.psa_real_capture`` (blocks by their true mass, the group's largest share
first) reads the heavy blocks first, so the count of blocks every query head of a group needs for 95 % of its mass is
exact on a distribution whose answer is known, and never above a random order's on random distributions."""

from __future__ import annotations

import torch

from bench.psa_real_capture import _blocks_for, _oracle_order


def _probs(logits: torch.Tensor) -> torch.Tensor:
    return torch.softmax(logits, dim=-1)


def test_oracle_reads_the_few_heavy_blocks_first():
    block, n_blocks = 4, 10
    logits = torch.full((2, block * n_blocks), -20.0)
    logits[0, 8:12] = 5.0    # head 0: all its mass in block 2
    logits[1, 28:32] = 5.0   # head 1: all its mass in block 7
    p = _probs(logits)
    order = _oracle_order(p, block, n_blocks)
    assert set(order[:2]) == {2, 7}
    assert _blocks_for(p, order, block, n_blocks) == 2
    assert _blocks_for(p, list(range(n_blocks)), block, n_blocks) == 8  # in block order: up to block 7


def test_oracle_never_needs_more_blocks_than_a_random_order():
    g = torch.Generator().manual_seed(0)
    block, n_blocks = 16, 64
    for _ in range(20):
        p = _probs(torch.randn(3, block * n_blocks - 5, generator=g) * 3.0)   # a partial last block
        oracle = _blocks_for(p, _oracle_order(p, block, n_blocks), block, n_blocks)
        other = _blocks_for(p, torch.randperm(n_blocks, generator=g).tolist(), block, n_blocks)
        assert 1 <= oracle <= other <= n_blocks
