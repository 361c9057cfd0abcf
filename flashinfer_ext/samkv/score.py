"""SamKV block selection maths (SamKV §3.1-3.2, Eq. 1-3, Appendix A): pure torch, fp32, no sglang.

Vocabulary: a document's KV is cut into blocks of ``block_size`` tokens (the last one may be short);
its first ``initial_blocks`` and last ``local_blocks`` are always kept (attention sinks and local
context), the rest are the *middle* blocks that selection keeps or drops.

* :func:`generic_query` - ``Q_que``: the question's queries mean-pooled over its tokens.
* :func:`personalized_queries` - Eq. 1: ``Q^_i = Q_que + 1/(D-1) * sum_{j != i} |cos(Q_que, Q_j,loc)| * Q_j,loc``
  (per query head; ``Q_que`` unchanged when ``D == 1`` or no local queries are given).
* :func:`block_mean_keys` - one mean key per block (``[blocks, kv_heads, head_dim]``).
* :func:`block_scores` - ``<Q^, K_block> / sqrt(head_dim)`` averaged over query heads (GQA: head
  ``h`` reads KV head ``h // (Hq / Hkv)``).
* :func:`anchor_top_p` - Eq. 2: ``P = (s_max - s_anc) / (s_max - s_min)`` if
  ``s_min < s_anc <= s_max`` else 0, with ``s_anc`` the score of the mean key of the initial + local
  (anchor) tokens and ``s_max`` / ``s_min`` the best / worst middle block.
* :func:`document_scores` - every document's token scores, block scores and Eq. 2 ``P`` of one layer in one
  pass (the batched form of the three functions above, index tensors from :class:`ScoreIndex`).
* :func:`select_middle_blocks` - Eq. 3 (``P_i`` averaged over the stable layers), each document's
  top ``ceil(P_i * middle_i)`` middle blocks by its layer-averaged score as candidates, scores
  min-max normalised per document (so documents compare on one scale; equal normalised scores -
  every document's best block is 1.0 - are ordered by the raw score, never by document order), and of
  all candidates the best ``total_blocks // D - always_kept_blocks`` kept (never negative: the paper's
  budget of ``total blocks / D`` counts the always-kept blocks too).
* :func:`anchor_layouts` - every document's :func:`block_layout`, local blocks trimmed when the
  always-kept blocks would take more than their share of the KV budget (short documents).
* :func:`kept_budget` - those layouts and the middle-block budget of a request from its documents' lengths
  alone (what the front door checks before choosing a pipeline, and what the selection then uses).

* :func:`question_block_mass` / :func:`select_mass_blocks` - the ``selection="mass"`` rule (not the paper's):
  each question row's softmax attention over *all* documents' tokens (position-free logits, per query head),
  averaged over rows and heads and summed per block; of all documents' middle blocks the ``budget`` with the
  most mass are kept. One scale for every document (no per-document normalisation, no Eq. 2 ratio).

Cautions: scores use position-free vectors (queries before RoPE, keys de-rotated to position 0) so a
block's score does not depend on where the document sits; the paper does not say which it uses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["generic_query", "personalized_queries", "block_mean_keys", "block_scores", "anchor_top_p",
           "block_layout", "anchor_layouts", "middle_budget", "select_middle_blocks", "ScoreIndex", "document_scores",
           "question_token_mass", "block_mass", "question_block_mass", "select_mass_blocks"]


def generic_query(q: torch.Tensor) -> torch.Tensor:
    """``q`` ``[tokens, q_heads, head_dim]`` -> ``Q_que`` ``[q_heads, head_dim]`` fp32 (mean over tokens)."""
    return q.float().mean(dim=0)


def personalized_queries(q_que: torch.Tensor, q_loc: torch.Tensor | None) -> torch.Tensor:
    """Eq. 1. ``q_que`` ``[q_heads, head_dim]``; ``q_loc`` ``[docs, q_heads, head_dim]`` (each document's
    local queries, mean-pooled) or ``None``. Returns ``[docs, q_heads, head_dim]`` fp32 (``[1, ...]`` when
    ``q_loc`` is None)."""
    q_que = q_que.float()
    if q_loc is None:
        return q_que.unsqueeze(0)
    q_loc = q_loc.float()
    d = q_loc.shape[0]
    if d == 1:
        return q_que.unsqueeze(0).clone()
    w = torch.nn.functional.cosine_similarity(q_loc, q_que.unsqueeze(0), dim=-1).abs()  # [docs, heads]
    contrib = w.unsqueeze(-1) * q_loc                                                   # [docs, heads, dim]
    others = contrib.sum(dim=0, keepdim=True) - contrib                                  # sum over j != i
    return q_que.unsqueeze(0) + others / (d - 1)


def block_mean_keys(k: torch.Tensor, block_size: int) -> torch.Tensor:
    """``k`` ``[tokens, kv_heads, head_dim]`` -> ``[ceil(tokens / block_size), kv_heads, head_dim]`` fp32
    (the last block averages its own tokens only)."""
    n = k.shape[0]
    nb = -(-n // block_size)
    k = k.float()
    pad = nb * block_size - n
    if pad:
        k = torch.cat([k, k.new_zeros((pad,) + tuple(k.shape[1:]))])
    sums = k.view(nb, block_size, *k.shape[1:]).sum(dim=1)
    counts = torch.full((nb,), float(block_size), device=k.device)
    counts[-1] = n - (nb - 1) * block_size
    return sums / counts.view(nb, 1, 1)


def block_scores(q_hat: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``q_hat`` ``[q_heads, head_dim]``, ``keys`` ``[n, kv_heads, head_dim]`` -> ``[n]`` fp32: scaled inner
    products averaged over query heads (GQA groups share their KV head)."""
    hq, dim = q_hat.shape
    hkv = keys.shape[1]
    if hq % hkv:
        raise ValueError(f"block_scores: q_heads={hq} is not a multiple of kv_heads={hkv}")
    k = keys.float().repeat_interleave(hq // hkv, dim=1)  # [n, hq, dim]
    return (k * q_hat.float().unsqueeze(0)).sum(-1).mean(-1) / math.sqrt(dim)


def anchor_top_p(s_anc: torch.Tensor, s_mid: torch.Tensor) -> torch.Tensor:
    """Eq. 2 per layer. ``s_anc`` ``[layers]``, ``s_mid`` ``[layers, middle_blocks]`` -> ``P`` ``[layers]`` in [0, 1]."""
    if s_mid.shape[-1] == 0:
        return torch.zeros_like(s_anc, dtype=torch.float32)
    s_max, s_min = s_mid.max(dim=-1).values.float(), s_mid.min(dim=-1).values.float()
    s_anc = s_anc.float()
    inside = (s_anc > s_min) & (s_anc <= s_max)
    p = (s_max - s_anc) / (s_max - s_min).clamp_min(1e-30)
    return torch.where(inside, p, torch.zeros_like(p))


def block_layout(n_tokens: int, block_size: int, initial_blocks: int, local_blocks: int):
    """``(blocks, always-kept block ids, middle block ids)`` of one document (python lists)."""
    nb = -(-n_tokens // block_size)
    always = sorted(set(range(min(initial_blocks, nb))) | set(range(max(0, nb - local_blocks), nb)))
    middle = [b for b in range(nb) if b not in set(always)]
    return nb, always, middle


def _block_tokens(n_tokens: int, block_size: int, blocks) -> int:
    return sum(min(n_tokens, (b + 1) * block_size) - b * block_size for b in blocks)


def anchor_layouts(lengths: list[int], block_size: int, initial_blocks: int, local_blocks: int,
                   max_anchor_tokens: int | None = None) -> tuple[list[tuple], int]:
    """:func:`block_layout` of every document, with the local blocks trimmed (the oldest first, one at a time,
    never below one) while the always-kept tokens of all documents exceed ``max_anchor_tokens`` (None: no
    trimming). Returns ``(layouts, local blocks used)``.

    Why: the always-kept (initial + local) blocks are taken from the same KV budget as the selected middle
    blocks; on short documents (e.g. 8 x ~190 tokens, 16-token blocks: 1 + 2 blocks are ~20 % of the tokens)
    they alone used the whole ``max_kept_ratio`` budget and no middle block could ever be kept (SamKV's
    selection was switched off). SamKV keeps initial + local blocks because they are a small part of long
    documents (§3.2: 1 + 2 blocks of 64 tokens); this keeps that premise on short ones."""
    lb = int(local_blocks)
    while True:
        layouts = [block_layout(n, block_size, initial_blocks, lb) for n in lengths]
        anchors = sum(_block_tokens(n, block_size, a) for n, (_, a, _) in zip(lengths, layouts))
        if max_anchor_tokens is None or anchors <= max_anchor_tokens or lb <= 1:
            return layouts, lb
        lb -= 1


def middle_budget(total_blocks: int, docs: int, always_kept: int, max_middle: int | None = None) -> int:
    """Middle blocks kept in all: the paper's ``total_blocks // D`` less the always-kept blocks of one document
    (never negative), capped by ``max_middle`` (the config's ``max_kept_ratio`` rule; None = no cap)."""
    budget = max(0, total_blocks // max(docs, 1) - always_kept)
    return budget if max_middle is None else min(budget, max(0, int(max_middle)))


@dataclass(frozen=True)
class KeptBudget:
    """The KV budget of one documents request, before any scoring (host-side, from the documents' lengths).

    ``layouts``: each document's :func:`block_layout` after :func:`anchor_layouts`' trimming; ``token_cap``: the
    ``max_kept_ratio`` cap in tokens (None: ratio 1, SamKV's rule alone); ``middle_blocks``: middle blocks kept
    in all (:func:`middle_budget`); ``docs_with_middle``: documents that have a middle block at all."""

    layouts: tuple
    token_cap: int | None
    middle_blocks: int
    docs_with_middle: int

    def __post_init__(self):
        if self.middle_blocks < 0 or self.docs_with_middle < 0:
            raise ValueError(f"KeptBudget: middle_blocks ({self.middle_blocks}) and docs_with_middle "
                             f"({self.docs_with_middle}) must be >= 0")


def kept_budget(lengths: list[int], block_size: int, initial_blocks: int, local_blocks: int,
                max_kept_ratio: float = 1.0, anchor_share: float = 1.0) -> KeptBudget:
    """The :class:`KeptBudget` of documents of ``lengths`` tokens: the same layouts and middle-block budget the
    selection uses (the smaller of SamKV's ``total_blocks // D - always kept`` and the ``max_kept_ratio`` rule
    ``(floor(ratio * tokens) - always-kept tokens) // block_size``)."""
    if not lengths or min(lengths) < 1:
        raise ValueError(f"kept_budget: lengths must be non-empty and positive, got {list(lengths)[:8]}")
    doc_tokens = sum(lengths)
    ratio = float(max_kept_ratio)
    token_cap = int(ratio * doc_tokens + 1e-9) if ratio < 1.0 else None
    layouts, _ = anchor_layouts(list(lengths), block_size, initial_blocks, local_blocks,
                                None if token_cap is None else int(float(anchor_share) * token_cap + 1e-9))
    d = len(lengths)
    always_total = sum(len(a) for _, a, _ in layouts)
    always_tokens = sum(_block_tokens(n, block_size, a) for n, (_, a, _) in zip(lengths, layouts))
    total_blocks = sum(nb for nb, _, _ in layouts)
    cap = None if token_cap is None else max(0, token_cap - always_tokens) // block_size
    return KeptBudget(tuple(layouts), token_cap,
                      middle_budget(total_blocks, d, always_total // max(1, d), cap),
                      sum(1 for _, _, m in layouts if m))


def select_middle_blocks(p_layers: list[torch.Tensor], s_layers: list[torch.Tensor], total_blocks: int,
                         always_kept: int, max_middle: int | None = None) -> list[list[int]]:
    """Eq. 3 + cross-document normalisation and budget.

    p_layers[i]: ``[stable_layers]`` Eq. 2 ratios of document i; s_layers[i]: ``[stable_layers, middle_i]``
    its middle blocks' scores. ``max_middle``: a cap on the middle blocks kept in all (the config's
    ``max_kept_ratio`` rule; None = SamKV's budget alone). Returns, per document, the kept middle positions (indices into its middle
    list, sorted).
    """
    d = len(s_layers)
    budget = middle_budget(total_blocks, d, always_kept, max_middle)
    cands = []  # (normalised score, raw layer-averaged score, doc, middle index)
    for i, (p, s) in enumerate(zip(p_layers, s_layers)):
        m = s.shape[-1]
        if m == 0:
            continue
        p_i = float(p.float().mean())                     # Eq. 3
        take = min(m, math.ceil(p_i * m - 1e-9))
        if take <= 0:
            continue
        mean = s.float().mean(dim=0)                      # layer-averaged block scores
        lo, hi = float(mean.min()), float(mean.max())
        norm = (mean - lo) / (hi - lo) if hi > lo else torch.ones_like(mean)
        top = torch.topk(mean, take).indices.tolist()
        cands += [(float(norm[j]), float(mean[j]), i, j) for j in top]
    # ties of the normalised score (each document's best block is 1.0) go to the higher raw score: ordering
    # them by document index gave a small budget to the first documents whatever their scores were
    cands.sort(key=lambda c: (-c[0], -c[1], c[2], c[3]))
    kept: list[list[int]] = [[] for _ in range(d)]
    for _, _, i, j in cands[:budget]:
        kept[i].append(j)
    return [sorted(k) for k in kept]


class ScoreIndex:
    """Index tensors for :func:`document_scores` of ``D`` documents laid end to end (document ``j`` has
    ``lengths[j]`` tokens; ``layouts[j]`` = :func:`block_layout` of it), built on the host and moved to
    ``device`` in one transfer. ``N`` = all tokens, ``TB`` = all blocks (documents in order), ``A`` / ``M`` =
    most anchor tokens / middle blocks of one document. Pads point one past the end (a zero row).

    tok_doc ``[N]`` (document of each token), tok_pos ``[N]`` (its position in its document), tok_lo / tok_hi
    ``[N]`` (its document's first token / one past its last, in all ``N``), blk_tok ``[TB * block_size]``,
    blk_doc ``[TB]``, blk_cnt ``[TB]`` fp32 (tokens per block), anc_tok ``[D * A]``, anc_cnt ``[D]`` fp32, mid_blk ``[D * M]`` (into ``TB``), mid_ok ``[D, M]`` bool; and on the
    host ``blk_start`` (first block of each document) for slicing the results.
    """

    def __init__(self, lengths: list[int], layouts: list[tuple], block_size: int, device):
        # host tensors (vectorised: the per-token python lists took ~9 ms at 8 x 1.9k tokens), one transfer
        bs = int(block_size)
        d = len(lengths)
        n_all = sum(lengths)
        nbs = [nb for nb, _, _ in layouts]
        tb = sum(nbs)
        n_t = torch.tensor(lengths, dtype=torch.int64)
        starts = torch.cumsum(n_t, 0) - n_t
        tok_doc = torch.repeat_interleave(torch.arange(d), n_t)
        tok_lo = starts[tok_doc]
        tok_hi = tok_lo + n_t[tok_doc]
        tok_pos = torch.arange(n_all) - tok_lo
        nb_t = torch.tensor(nbs, dtype=torch.int64)
        blk_first = torch.cumsum(nb_t, 0) - nb_t
        self.blk_start = blk_first.tolist()
        blk_doc = torch.repeat_interleave(torch.arange(d), nb_t)
        lo = starts[blk_doc] + (torch.arange(tb) - blk_first[blk_doc]) * bs
        hi = torch.minimum(starts[blk_doc] + n_t[blk_doc], lo + bs)
        blk_tok = lo.unsqueeze(1) + torch.arange(bs).unsqueeze(0)
        blk_tok = torch.where(blk_tok < hi.unsqueeze(1), blk_tok, torch.full_like(blk_tok, n_all)).reshape(-1)
        anc, mids = [], []
        for j, (n, (nb, always, middle)) in enumerate(zip(lengths, layouts)):
            st = int(starts[j])
            anc.append([p for b in always for p in range(st + b * bs, min(st + n, st + (b + 1) * bs))])
            mids.append([self.blk_start[j] + b for b in middle])
        self.n_tokens, self.n_blocks, self.docs, self.block_size = n_all, tb, d, bs
        self.a = max(1, max(len(x) for x in anc))
        self.m = max(len(x) for x in mids)
        anc_tok = torch.tensor([p for x in anc for p in x + [n_all] * (self.a - len(x))], dtype=torch.int64)
        mid_blk = torch.tensor([p for x in mids for p in x + [tb] * (self.m - len(x))], dtype=torch.int64)
        mid_ok = torch.tensor([int(i < len(x)) for x in mids for i in range(self.m)], dtype=torch.int64)
        ints = [tok_doc, tok_pos, tok_lo, tok_hi, blk_tok, blk_doc, anc_tok, mid_blk, mid_ok]
        flat = torch.cat([x.reshape(-1) for x in ints])
        floats = torch.cat([(hi - lo).float(), torch.tensor([float(len(x)) for x in anc])])
        dev_i, dev_f = flat.to(device), floats.to(device)
        (self.tok_doc, self.tok_pos, self.tok_lo, self.tok_hi, self.blk_tok, self.blk_doc, self.anc_tok, self.mid_blk,
         mid_ok_t) = dev_i.split([x.numel() for x in ints])
        self.mid_ok = mid_ok_t.view(d, self.m).bool()
        self.blk_cnt, self.anc_cnt = dev_f.split([tb, d])


def _scores_rows(q_rows: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Row-wise :func:`block_scores`: ``q_rows`` ``[R, q_heads, dim]``, ``keys`` ``[R, kv_heads, dim]`` -> ``[R]`` fp32."""
    hq, dim = q_rows.shape[-2:]
    hkv = keys.shape[-2]
    if hq % hkv:
        raise ValueError(f"document_scores: q_heads={hq} is not a multiple of kv_heads={hkv}")
    k = keys.float().repeat_interleave(hq // hkv, dim=-2)
    return (k * q_rows.float()).sum(-1).mean(-1) / math.sqrt(dim)


def document_scores(k0: torch.Tensor, q_hat: torch.Tensor, index: ScoreIndex) -> tuple[torch.Tensor, ...]:
    """One layer, every document at once: the batched form of the per-document loop (``block_mean_keys``,
    the anchor mean key, ``block_scores`` of tokens / middle blocks / anchor and ``anchor_top_p``).

    k0 ``[N, kv_heads, dim]``: every document's keys at position 0, documents end to end (any float dtype);
    q_hat ``[D, q_heads, dim]`` (or ``[1, ...]``: one query for every document) fp32.
    Returns ``(P [D], block scores [TB], token scores [N])`` fp32: ``P`` is Eq. 2 against the document's middle
    blocks (0 for a document without middle blocks), block scores are every block's mean-key score against its
    document's query, token scores every token's.
    """
    n, hkv, dim = k0.shape
    if n != index.n_tokens:
        raise ValueError(f"document_scores: {n} keys for an index of {index.n_tokens} tokens")
    q = q_hat.float()
    if q.shape[0] == 1:
        q = q.expand(index.docs, *q.shape[1:])
    kf = torch.cat([k0.float(), k0.new_zeros((1, hkv, dim), dtype=torch.float32)])   # row N = the pad
    tok = _scores_rows(q.index_select(0, index.tok_doc), kf[:n])
    sums = kf.index_select(0, index.blk_tok).view(index.n_blocks, index.block_size, hkv, dim).sum(dim=1)
    means = sums / index.blk_cnt.view(-1, 1, 1)
    blk = _scores_rows(q.index_select(0, index.blk_doc), means)
    anc = kf.index_select(0, index.anc_tok).view(index.docs, index.a, hkv, dim).sum(dim=1) / index.anc_cnt.view(-1, 1, 1)
    s_anc = _scores_rows(q, anc)
    if index.m == 0:
        return torch.zeros_like(s_anc), blk, tok
    mid = torch.cat([blk, blk.new_zeros(1)]).index_select(0, index.mid_blk).view(index.docs, index.m)
    s_max = mid.masked_fill(~index.mid_ok, float("-inf")).max(dim=-1).values
    s_min = mid.masked_fill(~index.mid_ok, float("inf")).min(dim=-1).values
    inside = (s_anc > s_min) & (s_anc <= s_max) & index.mid_ok.any(dim=-1)
    p = (s_max - s_anc) / (s_max - s_min).clamp_min(1e-30)
    return torch.where(inside, p, torch.zeros_like(p)), blk, tok


def question_token_mass(k0: torch.Tensor, q_rows: torch.Tensor, scale: float,
                        chunk_elems: int = 1 << 26) -> torch.Tensor:
    """The question's attention mass per token, one layer, every document at once.

    k0 ``[N, kv_heads, dim]``: every document's keys at position 0 (any float dtype), documents end to end;
    q_rows ``[T, q_heads, dim]``: the question rows' queries before RoPE (any float dtype); ``scale`` the
    softmax scale (``1 / sqrt(dim)``). Each row and query head gets one softmax over all ``N`` keys (GQA: head
    ``h`` reads KV head ``h // (q_heads / kv_heads)``); the probabilities are averaged over rows and heads.
    Returns ``[N]`` fp32 (sums to 1). Memory: the probabilities of a chunk of rows at a time, at most
    ``chunk_elems`` fp32 (or one row's ``q_heads * N``).
    """
    n, hkv, dim = k0.shape
    t, hq, qdim = q_rows.shape
    if qdim != dim or hq % hkv:
        raise ValueError(f"question_token_mass: q_rows {tuple(q_rows.shape)} do not fit keys {tuple(k0.shape)} "
                         "(head_dim must match, q_heads a multiple of kv_heads)")
    q = q_rows.float().view(t, hkv, hq // hkv, dim)
    kf = k0.float()
    # rows in chunks: the fp32 probabilities of one chunk stay under ~2^26 elements (256 MB), whatever the
    # documents' length (a 128k-token request with 32 query heads would need 16 MB per question row)
    step = max(1, int(chunk_elems) // max(1, hq * n))
    tok = torch.zeros(n, dtype=torch.float32, device=k0.device)
    for r0 in range(0, t, step):
        logits = torch.einsum("tkgd,nkd->kgtn", q[r0:r0 + step], kf) * float(scale)  # [kv_heads, group, rows, N]
        tok += logits.softmax(dim=-1).sum(dim=(0, 1, 2))
    return tok / (t * hq)


def block_mass(tok: torch.Tensor, index: ScoreIndex, spread: int = 0) -> torch.Tensor:
    """Per-token mass ``tok`` ``[N]`` (e.g. :func:`question_token_mass`, summed over layers) -> per-block mass
    ``[TB]`` fp32.

    ``spread`` > 0 (tokens): every token's mass is first shared evenly over the ``2 * spread + 1`` tokens
    around it, within its own document (a box filter; mass that would fall outside the document is dropped).
    A block then scores the mass of the tokens within ``spread`` of it, weighted by how much of their window
    it holds, so the block right after a heavy token at a block's end scores nearly as high as that block.
    Why: on the H100 accuracy set (8 x ~400 words, 16-token blocks) every samkv miss had kept the block the
    question attended to and dropped the next one, which held the end of the answer (a number's last digit).
    """
    n = tok.shape[0]
    if n != index.n_tokens:
        raise ValueError(f"block_mass: {n} token masses for an index of {index.n_tokens} tokens")
    tok = tok.float()
    w = int(spread)
    if w < 0:
        raise ValueError(f"block_mass: spread={w} must be >= 0")
    if w:
        csum = torch.cat([tok.new_zeros(1, dtype=torch.float64), tok.double().cumsum(0)])
        t = torch.arange(n, device=tok.device)
        lo = torch.maximum(index.tok_lo, t - w)
        hi = torch.minimum(index.tok_hi, t + w + 1)
        tok = ((csum.index_select(0, hi) - csum.index_select(0, lo)) / (2 * w + 1)).float()
    tok = torch.cat([tok, tok.new_zeros(1)])                                    # row N = the pad
    return tok.index_select(0, index.blk_tok).view(index.n_blocks, index.block_size).sum(dim=1)


def question_block_mass(k0: torch.Tensor, q_rows: torch.Tensor, index: ScoreIndex, scale: float,
                        chunk_elems: int = 1 << 26, spread: int = 0) -> torch.Tensor:
    """The question's attention mass per block, one layer, every document at once:
    :func:`question_token_mass` then :func:`block_mass` (``spread`` 0: plain block sums, which add up to 1).
    Shapes as there; returns ``[TB]`` fp32."""
    if k0.shape[0] != index.n_tokens:
        raise ValueError(f"question_block_mass: {k0.shape[0]} keys for an index of {index.n_tokens} tokens")
    return block_mass(question_token_mass(k0, q_rows, scale, chunk_elems), index, spread)


def question_block_mass_reference(k_docs: list[torch.Tensor], q_rows: torch.Tensor, block_size: int,
                                  scale: float, spread: int = 0) -> list[torch.Tensor]:
    """Loop reference of :func:`question_block_mass`: ``k_docs[j]`` ``[n_j, kv_heads, dim]``; returns per document
    its blocks' mass ``[ceil(n_j / block_size)]`` fp32 (``spread``: each token's mass shared over the tokens
    within ``spread`` of it in its document, ``1 / (2 * spread + 1)`` each)."""
    k = torch.cat([x.float() for x in k_docs])
    hq, hkv = q_rows.shape[1], k.shape[1]
    probs = torch.zeros(k.shape[0])
    for h in range(hq):
        for r in range(q_rows.shape[0]):
            probs += torch.softmax((k[:, h // (hq // hkv)] @ q_rows[r, h].float()) * scale, dim=0)
    probs /= hq * q_rows.shape[0]
    out, start = [], 0
    for x in k_docs:
        n = x.shape[0]
        if spread:
            own = probs[start:start + n].clone()
            spread_probs = torch.zeros(n)
            for u in range(n):
                for t in range(max(0, u - spread), min(n, u + spread + 1)):
                    spread_probs[t] += own[u] / (2 * spread + 1)
            probs[start:start + n] = spread_probs
        out.append(torch.stack([probs[start + b: start + min(n, b + block_size)].sum()
                                for b in range(0, n, block_size)]))
        start += n
    return out


def select_mass_blocks(mass: list[torch.Tensor], layouts: list[tuple], budget: int) -> list[list[int]]:
    """The ``selection="mass"`` rule: ``mass[j]`` ``[blocks_j]`` (document j's blocks, layer-summed
    :func:`question_block_mass`), ``layouts[j]`` its :func:`block_layout`. Of all documents' middle blocks the
    ``budget`` with the most mass are kept (ties: earlier document, then earlier block). Returns, per document,
    the kept positions in its middle list (sorted), as :func:`select_middle_blocks` does."""
    cands = []
    for j, (m, (_, _, middle)) in enumerate(zip(mass, layouts)):
        vals = m.float().tolist()
        cands += [(-vals[b], j, i) for i, b in enumerate(middle)]
    cands.sort()
    kept: list[list[int]] = [[] for _ in layouts]
    for _, j, i in cands[:max(0, int(budget))]:
        kept[j].append(i)
    return [sorted(k) for k in kept]
