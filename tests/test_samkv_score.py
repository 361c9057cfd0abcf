"""flashinfer_ext.samkv.score: SamKV Eq. 1-3 and the cross-document budget against loop references."""

from __future__ import annotations

import math

import pytest
import torch

from flashinfer_ext.samkv.score import (anchor_layouts, anchor_top_p, block_layout, block_mean_keys, block_scores,
                                        generic_query, personalized_queries, select_mass_blocks,
                                        select_middle_blocks)


def test_personalized_queries_match_eq1_loop():
    g = torch.Generator().manual_seed(0)
    q_que = torch.randn(4, 8, generator=g)
    q_loc = torch.randn(3, 4, 8, generator=g)
    got = personalized_queries(q_que, q_loc)
    for i in range(3):
        for h in range(4):
            ref = q_que[h].clone()
            for j in range(3):
                if j != i:
                    cos = torch.dot(q_que[h], q_loc[j, h]) / (q_que[h].norm() * q_loc[j, h].norm())
                    ref += abs(float(cos)) * q_loc[j, h] / 2
            torch.testing.assert_close(got[i, h], ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(personalized_queries(q_que, None)[0], q_que)
    assert torch.equal(personalized_queries(q_que, q_loc[:1])[0], q_que)  # D == 1: no bias


def test_block_mean_keys_and_scores_against_loops():
    g = torch.Generator().manual_seed(1)
    k = torch.randn(10, 2, 4, generator=g).to(torch.bfloat16)
    means = block_mean_keys(k, 4)
    assert means.shape == (3, 2, 4) and means.dtype == torch.float32
    torch.testing.assert_close(means[0], k[:4].float().mean(0))
    torch.testing.assert_close(means[2], k[8:].float().mean(0))  # short last block: its own tokens only
    q = torch.randn(6, 4, generator=g)  # 6 q heads over 2 kv heads (groups of 3)
    s = block_scores(q, means)
    for b in range(3):
        ref = sum(float(q[h] @ means[b, h // 3]) for h in range(6)) / 6 / math.sqrt(4)
        assert abs(float(s[b]) - ref) < 1e-5
    with pytest.raises(ValueError, match="not a multiple"):
        block_scores(torch.randn(5, 4), means)
    assert torch.equal(generic_query(torch.ones(3, 2, 2) * 2), torch.full((2, 2), 2.0))


@pytest.mark.parametrize("s_anc,s_mid,expected", [
    (1.0, [0.0, 2.0, 3.0], (3.0 - 1.0) / 3.0),   # anchor inside (min, max]
    (3.0, [0.0, 2.0, 3.0], 0.0),                 # anchor == max: inside, P = 0
    (0.0, [0.0, 2.0, 3.0], 0.0),                 # anchor == min: outside (open at min)
    (5.0, [0.0, 2.0, 3.0], 0.0),                 # anchor above every block
    (-1.0, [0.0, 2.0, 3.0], 0.0),                # anchor below every block
])
def test_anchor_top_p_is_eq2(s_anc, s_mid, expected):
    p = anchor_top_p(torch.tensor([s_anc]), torch.tensor([s_mid]))
    assert abs(float(p[0]) - expected) < 1e-6


def test_block_layout_keeps_initial_and_local():
    assert block_layout(130, 64, 1, 2) == (3, [0, 1, 2], [])
    assert block_layout(64 * 6, 64, 1, 2) == (6, [0, 4, 5], [1, 2, 3])
    assert block_layout(10, 4, 0, 0) == (3, [], [0, 1, 2])


def test_select_middle_blocks_budget_topp_and_normalisation():
    # doc 0: P = 0.5 of 4 middle blocks -> candidates its top 2 (blocks 3, 1); doc 1: P = 0 -> none;
    # doc 2: P = 1 of 2 -> both. Budget total 24 // 3 - 6 = 2 -> the two best normalised candidates.
    p = [torch.tensor([0.5, 0.5]), torch.tensor([0.0, 0.0]), torch.tensor([1.0, 1.0])]
    s = [torch.tensor([[0.0, 5.0, 1.0, 9.0]] * 2), torch.tensor([[7.0, 1.0]] * 2), torch.tensor([[2.0, 4.0]] * 2)]
    kept = select_middle_blocks(p, s, total_blocks=24, always_kept=6)
    # normalised: doc0 block3 -> 1.0, block1 -> 5/9; doc2 block1 -> 1.0, block0 -> 0.0
    assert kept == [[3], [], [1]]
    assert select_middle_blocks(p, s, total_blocks=24, always_kept=8) == [[], [], []]  # no budget left
    wide = select_middle_blocks(p, s, total_blocks=300, always_kept=0)
    assert wide == [[1, 3], [], [0, 1]]  # budget never exceeds the top-P candidates


def test_select_middle_blocks_orders_tied_normalised_scores_by_raw_score_not_document_order():
    # every document's best block normalises to 1.0; with a budget of one block the document whose best
    # block scores higher gets it (before: the first document, whatever its scores)
    p = [torch.tensor([1.0]), torch.tensor([1.0])]
    s = [torch.tensor([[0.0, 1.0]]), torch.tensor([[0.0, 10.0]])]
    assert select_middle_blocks(p, s, total_blocks=20, always_kept=0, max_middle=1) == [[], [1]]
    s_swapped = [s[1], s[0]]
    assert select_middle_blocks(p, s_swapped, total_blocks=20, always_kept=0, max_middle=1) == [[1], []]


def _anchor_tokens(lengths, layouts, bs):
    return sum(min(n, (b + 1) * bs) - b * bs for n, (_, a, _) in zip(lengths, layouts) for b in a)


def test_anchor_layouts_trim_local_blocks_of_short_documents_to_leave_budget_for_middle_blocks():
    # 8 documents of ~190 tokens, 16-token blocks: 1 initial + 2 local blocks are ~22 % of the tokens, i.e.
    # more than a 0.2 KV budget: no middle block could be kept. Anchors may take half of it -> one local block.
    lengths, bs = [190, 185, 201, 176, 193, 188, 199, 181], 16
    cap = int(0.2 * sum(lengths))
    full = [block_layout(n, bs, 1, 2) for n in lengths]
    assert _anchor_tokens(lengths, full, bs) > cap
    layouts, lb = anchor_layouts(lengths, bs, 1, 2, cap // 2)
    assert lb == 1 and layouts == [block_layout(n, bs, 1, 1) for n in lengths]
    assert _anchor_tokens(lengths, layouts, bs) < cap and all(m for _, _, m in layouts)
    # long documents (8 x 960 tokens) keep the configured anchors; no limit = no trimming; never below one
    long_layouts, lb_long = anchor_layouts([960] * 8, bs, 1, 2, int(0.2 * 960 * 8) // 2)
    assert lb_long == 2 and long_layouts == [block_layout(960, bs, 1, 2)] * 8
    assert anchor_layouts(lengths, bs, 1, 2, None)[1] == 2
    assert anchor_layouts(lengths, bs, 1, 3, 0)[1] == 1


def _per_document_reference(k0, q_hat, lengths, layouts, bs):
    """The per-document loop the scheduler ran before the batched form (one layer)."""
    p, blk, tok, start = [], [], [], 0
    for j, (n, (nb, always, middle)) in enumerate(zip(lengths, layouts)):
        k = k0[start:start + n]
        q = q_hat[min(j, q_hat.shape[0] - 1)]
        means = block_mean_keys(k, bs)
        anchor = torch.cat([k[b * bs:(b + 1) * bs] for b in always]).float().mean(0, keepdim=True)
        s_mid = block_scores(q, means[middle]) if middle else means.new_zeros(0)
        p.append(anchor_top_p(block_scores(q, anchor), s_mid.unsqueeze(0))[0])
        blk.append(block_scores(q, means))
        tok.append(block_scores(q, k))
        start += n
    return torch.stack(p), torch.cat(blk), torch.cat(tok)


@pytest.mark.parametrize("lengths,bs,personal", [
    ([70, 33, 129, 5, 64], 16, True),   # short last blocks, a one-block document, an exact multiple
    ([300, 250, 280], 32, False),       # one query for every document
    ([40, 20], 16, True),               # no middle blocks anywhere
])
def test_document_scores_equal_the_per_document_loop_and_select_the_same_blocks(lengths, bs, personal):
    from flashinfer_ext.samkv.score import ScoreIndex, document_scores

    g = torch.Generator().manual_seed(sum(lengths))
    k0 = torch.randn(sum(lengths), 3, 8, generator=g).to(torch.bfloat16)
    q_hat = torch.randn(len(lengths) if personal else 1, 6, 8, generator=g)
    layouts = [block_layout(n, bs, 1, 2) for n in lengths]
    index = ScoreIndex(lengths, layouts, bs, "cpu")
    assert index.tok_pos.tolist() == [p for n in lengths for p in range(n)]
    p, blk, tok = document_scores(k0, q_hat, index)
    p_ref, blk_ref, tok_ref = _per_document_reference(k0, q_hat, lengths, layouts, bs)
    torch.testing.assert_close(tok, tok_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(blk, blk_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(p, p_ref, rtol=1e-4, atol=1e-5)
    # the selection the scheduler makes from them is the same
    def mids(b):
        return [b[index.blk_start[j] + m[0]:index.blk_start[j] + m[-1] + 1].unsqueeze(0) if m else b.new_zeros(1, 0)
                for j, (_, _, m) in enumerate(layouts)]
    total = sum(nb for nb, _, _ in layouts)
    got = select_middle_blocks([x.unsqueeze(0) for x in p], mids(blk), total, 3)
    want = select_middle_blocks([x.unsqueeze(0) for x in p_ref], mids(blk_ref), total, 3)
    assert got == want
    if any(m for _, _, m in layouts):
        assert any(got), "the case selects nothing: it would not tell a wrong selection apart"


@pytest.mark.parametrize("lengths,bs,hq,hkv,dtype", [
    ([70, 33, 129, 5, 64], 16, 6, 3, torch.bfloat16),   # short last blocks, a one-block document, GQA 2
    ([300, 250, 280], 32, 4, 4, torch.float16),        # MHA
    ([40], 8, 8, 1, torch.float32),                    # one document, MQA
])
def test_question_block_mass_equals_the_softmax_loop_over_all_documents(lengths, bs, hq, hkv, dtype):
    from flashinfer_ext.samkv.score import ScoreIndex, question_block_mass, question_block_mass_reference

    g = torch.Generator().manual_seed(len(lengths) * 7 + bs)
    k_docs = [torch.randn(n, hkv, 16, generator=g).to(dtype) for n in lengths]
    q = torch.randn(5, hq, 16, generator=g).to(dtype)
    index = ScoreIndex(lengths, [block_layout(n, bs, 1, 1) for n in lengths], bs, "cpu")
    got = question_block_mass(torch.cat(k_docs), q, index, 0.25)
    want = torch.cat(question_block_mass_reference(k_docs, q, bs, 0.25))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    # rows in chunks (here 1 and 2 rows at a time) give the same mass
    for rows in (1, 2):
        chunked = question_block_mass(torch.cat(k_docs), q, index, 0.25, chunk_elems=rows * hq * sum(lengths))
        torch.testing.assert_close(chunked, want, rtol=1e-5, atol=1e-7)
    assert abs(float(got.sum()) - 1.0) < 1e-5
    with pytest.raises(ValueError, match="keys for an index"):
        question_block_mass(torch.cat(k_docs)[1:], q, index, 0.25)


@pytest.mark.parametrize("lengths,bs,spread,dtype", [
    ([70, 33, 129, 5, 64], 16, 3, torch.bfloat16),     # short last blocks, a document shorter than the window
    ([300, 250], 32, 8, torch.float16),
    ([40], 8, 20, torch.float32),                      # window wider than the document
])
def test_spread_block_mass_equals_the_loop_reference(lengths, bs, spread, dtype):
    from flashinfer_ext.samkv.score import ScoreIndex, question_block_mass, question_block_mass_reference

    g = torch.Generator().manual_seed(spread)
    k_docs = [torch.randn(n, 2, 16, generator=g).to(dtype) for n in lengths]
    q = torch.randn(3, 4, 16, generator=g).to(dtype)
    index = ScoreIndex(lengths, [block_layout(n, bs, 1, 1) for n in lengths], bs, "cpu")
    got = question_block_mass(torch.cat(k_docs), q, index, 0.25, spread=spread)
    want = torch.cat(question_block_mass_reference(k_docs, q, bs, 0.25, spread=spread))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    # mass is only lost at document edges, never gained
    assert float(got.sum()) <= 1.0 + 1e-5
    assert not torch.allclose(got, question_block_mass(torch.cat(k_docs), q, index, 0.25))


def test_spread_keeps_the_block_after_a_heavy_token_at_a_block_end():
    """The contract behind ``mass_spread``: a fact whose attended token is the last of its block and whose end
    (say a number's last digit) is in the next block. Plain block sums rank that next block below a block of
    diffuse mass; spread over 8 tokens, it is kept with the heavy block under a budget of two."""
    from flashinfer_ext.samkv.score import ScoreIndex, block_mass

    bs, n = 16, 96                                     # blocks 0 .. 5: 0 initial, 5 local, middle 1 .. 4
    layouts = [block_layout(n, bs, 1, 1)]
    index = ScoreIndex([n], layouts, bs, "cpu")
    tok = torch.full((n,), 0.002)
    tok[3 * bs - 1] = 0.5                              # heavy token: the last one of block 2 (middle index 1)
    tok[4 * bs: 5 * bs] += 0.01                        # block 4 (middle index 3): diffuse mass
    plain = [block_mass(tok, index, 0)]
    assert select_mass_blocks(plain, layouts, 2) == [[1, 3]]           # block 3, right after the heavy token, dropped
    spread = [block_mass(tok, index, 8)]
    assert select_mass_blocks(spread, layouts, 2) == [[1, 2]]          # blocks 2 and 3 kept, the diffuse one not
    with pytest.raises(ValueError, match="spread"):
        block_mass(tok, index, -1)


def test_question_block_mass_finds_the_block_a_planted_key_is_in():
    """A key equal to the question's query direction, in the middle of the third document, puts that block
    first in all documents' ranking (the rule compares documents on one scale)."""
    from flashinfer_ext.samkv.score import ScoreIndex, question_block_mass

    g = torch.Generator().manual_seed(3)
    lengths, bs = [64, 64, 96, 64], 16
    k = 0.1 * torch.randn(sum(lengths), 2, 32, generator=g)
    q = torch.randn(4, 4, 32, generator=g)
    k[128 + 40] = 3.0 * q.mean(0).view(2, 2, 32).mean(1)          # document 2, block 2 (a middle block)
    layouts = [block_layout(n, bs, 1, 1) for n in lengths]
    index = ScoreIndex(lengths, layouts, bs, "cpu")
    mass = question_block_mass(k, q, index, 32 ** -0.5)
    docs = list(mass.split([-(-n // bs) for n in lengths]))
    assert select_mass_blocks(docs, layouts, 1) == [[], [], [1], []]   # middle list of doc 2 is [1, 2, 3, 4]


def test_select_mass_blocks_keeps_the_heaviest_middle_blocks_of_all_documents():
    layouts = [block_layout(n, 4, 1, 1) for n in (20, 12, 4)]     # middle: [1, 2, 3], [1], []
    mass = [torch.tensor([0.9, 0.1, 0.3, 0.2, 0.9]), torch.tensor([0.5, 0.25, 0.5]), torch.tensor([1.0])]
    # middle masses: document 0 [0.1, 0.3, 0.2], document 1 [0.25]; the always-kept blocks' mass does not count
    assert select_mass_blocks(mass, layouts, 2) == [[1], [0], []]
    assert select_mass_blocks(mass, layouts, 3) == [[1, 2], [0], []]
    assert select_mass_blocks(mass, layouts, 0) == [[], [], []]
    assert select_mass_blocks(mass, layouts, 99) == [[0, 1, 2], [0], []]
    # ties: earlier document first
    assert select_mass_blocks([torch.tensor([0, .5, 0]), torch.tensor([0, .5, 0])],
                              [block_layout(12, 4, 1, 1)] * 2, 1) == [[0], []]
