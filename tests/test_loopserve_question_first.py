"""Contract: LoopServe's prefill lines keep the attention of the rows that carry the answer.

Root cause of issue 24 (bench/results/loopserve_root_cause.md): the lines are chosen to cover ``alpha``
of the mass of ~64 SAMPLED query rows; the few rows of the fact the answer copies (a needle sentence,
~14 of ~2k rows) are not sampled, and in several (layer, KV head) pairs their own coverage falls far
below ``alpha`` (here 0.86 mean, 0.58 worst row at alpha 0.955). Over 30 layers that lost the number
(CPU reference: sparse prefill + dense decode fails, dense-prefilling only those 14 rows restores it).

Real capture (tests/data/loopserve_fact_rows_l15.pt, < 300 KB): SmolLM2-135M-Instruct-32k, layer 15,
KV head 0, of a chat3 turn (see its ``source`` field). Pure torch references, runs in about a second.
"""

from pathlib import Path

import pytest
import torch

from flashinfer_ext.loopserve.reference import covered_mass_reference, vs_estimate_reference
from flashinfer_ext.loopserve.vs_estimate import VSLineSums
from flashinfer_ext.loopserve.vs_select import VSSelectConfig, vs_select
from sglang_sparse.config import LoopServeConfig

DATA = Path(__file__).parent / "data" / "loopserve_fact_rows_l15.pt"
FACT_ROWS_MIN_COVERAGE = 0.95  # mean covered fraction of the fact rows' own attention mass


def _fact_row_coverage(alpha: float):
    d = torch.load(DATA)
    q, pos, k, n, ns, sc = d["q"].float(), d["q_pos"], d["k"].float(), d["seq_len"], d["n_sampled"], d["sm_scale"]
    slots = torch.arange(n)
    est = vs_estimate_reference(q[:ns], pos[:ns], k, slots, n, sc)
    cfg = LoopServeConfig()
    sel = vs_select(VSLineSums(*est, q.shape[1], ns), prefix_len=0,
                    config=VSSelectConfig(alpha=alpha, sink_tokens=cfg.sink_tokens, local_window=cfg.local_window))
    lines = (sel.v_idx, sel.v_cnt, sel.s_idx, sel.s_cnt)
    sampled = float(covered_mass_reference(q[:ns], pos[:ns], k, slots, n, sc, *lines))
    per_row = [float(covered_mass_reference(q[i:i + 1], pos[i:i + 1], k, slots, n, sc, *lines))
               for i in range(ns, q.shape[0])]
    return sampled, sum(per_row) / len(per_row), min(per_row)


def test_sampled_rows_reach_alpha():
    """The selection keeps its own guarantee on the rows it sampled (not the bug)."""
    sampled, _, _ = _fact_row_coverage(LoopServeConfig().alpha)
    assert sampled >= LoopServeConfig().alpha


def test_fact_rows_keep_their_attention_at_default_alpha():
    """At 0.955 (the earlier default) the unsampled fact rows kept only 0.86 of their mass (worst row 0.58)."""
    _, mean, worst = _fact_row_coverage(LoopServeConfig().alpha)
    assert mean >= FACT_ROWS_MIN_COVERAGE, (mean, worst)


def test_fact_rows_keep_their_attention_at_alpha_099():
    """alpha 0.99 (the paper sweeps 0.98-1.0) keeps them; on the CPU reference it restored both answers
    that loopserve alone lost in the sample (chat3 begin seed 0, end seed 0)."""
    _, mean, worst = _fact_row_coverage(0.99)
    assert mean >= FACT_ROWS_MIN_COVERAGE, (mean, worst)
