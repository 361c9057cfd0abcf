"""SamKV block selection inside the scheduler (variant ``samkv``): which blocks of each document the
composite context keeps (SamKV §3.1-3.2; maths in :mod:`flashinfer_ext.samkv.score`).

1. Anchor context: the tokens of every document's initial + local blocks, their cached KV gathered from
   the pool, keys re-rotated to consecutive positions ``0 .. C-1`` (all layers).
2. Side forward (:func:`sglang_sparse.samkv.side.side_forward`: the model's own modules - embedding, norms,
   QKV / O projections, RoPE, MLP - layer by layer, with the attention computed here in torch) of two kinds of rows over that
   context: the question tokens (the request's prompt after the documents; each sees the whole anchor
   context and the question up to itself) and every document's last ``local_query_tokens`` tokens (each
   sees its own document's anchor tokens up to itself). Kept: the pre-RoPE queries of the last ``stable_layers``
   layers (and, under ``selection="mass"``, of the layers ``mass_layer_range``); mean-pooled they are ``Q_que``
   and each document's local query ``Q_doc-j,loc``. Their KV is
   thrown away; SGLang prefills the question again over the selected context (SamKV's "re-perform an
   incremental prefill of the user query").
3. Per stable layer and document: personalised query (Eq. 1), keys de-rotated to position 0, mean key
   per block, Eq. 2-3, then the cross-document budget
   (:func:`flashinfer_ext.samkv.score.select_middle_blocks`; ``selection="anchor_top_p"``). Each token's
   layer-averaged score against its document's personalised query is returned too (the recompute set is
   chosen by it).
4. ``selection="mass"`` (the default; not the paper's rule): the question rows' softmax attention over all
   documents' position-0 keys, per mass layer (:func:`flashinfer_ext.samkv.score.question_token_mass`), summed
   over the layers, spread ``mass_spread`` tokens each way and summed per block
   (:func:`flashinfer_ext.samkv.score.block_mass`); the heaviest middle blocks of all documents are kept within
   the same budget
   (:func:`flashinfer_ext.samkv.score.select_mass_blocks`).

Departure (stated in the README): SGLang keeps no Q cache, so a document's local queries come from its
local tokens run over its own initial + local tokens, not over the whole document. Supports Llama-style
decoder stacks (``model.model.layers[i].self_attn.qkv_proj`` etc.); other models raise and the request is
served densely.
"""

from __future__ import annotations

import torch

from flashinfer_ext.samkv.score import (ScoreIndex, block_mass, document_scores, generic_query, kept_budget,
                                        personalized_queries, question_token_mass, select_mass_blocks,
                                        select_middle_blocks)
from sglang_sparse.samkv.graph import side_rows_forward


def _gather_context(rt, pool, spans, srcs, layouts, bs, ids, local_tokens, question_ids, cached_at: int = 0):
    """The anchor context (initial + local blocks of every document) at positions ``0..C-1``: per layer
    ``(K, V)`` ``[C, kv_heads, head_dim]``, and (device int64 tensors, one host->device transfer for all) per
    context row its token id ``[C]``, document ``[C]``, position in the document ``[C]``; the context rows of each
    document's last ``local_tokens`` tokens (its local-query rows) ``[L]``; the question's token ids ``[T]``."""
    gidx, delta, tok_ids, doc_of, pos_in, local, pos, base = [], [], [], [], [], [], 0, 0
    for d, ((s, n), (nb, always, _)) in enumerate(zip(spans, layouts)):
        tok = [p for b in always for p in range(b * bs, min(n, (b + 1) * bs))]
        loc_from = max(0, n - local_tokens)
        local += [pos + i for i, p in enumerate(tok) if p >= loc_from]
        gidx += [base + p for p in tok]
        delta += [pos + i - p - cached_at for i, p in enumerate(tok)]
        tok_ids += [ids[s + p] for p in tok]
        doc_of += [d] * len(tok)
        pos_in += tok
        pos += len(tok)
        base += n
    src_all = srcs[0] if len(srcs) == 1 else torch.cat(list(srcs))
    dev = src_all.device
    parts = [gidx, delta, tok_ids, doc_of, pos_in, local, list(question_ids)]
    host = torch.tensor([v for x in parts for v in x], dtype=torch.int64)
    gidx_t, delta_t, ids_t, doc_t, pos_t, loc_t, q_t = host.to(dev).split([len(x) for x in parts])
    slots = src_all.index_select(0, gidx_t)
    ks, vs = [], []
    for layer in range(rt.num_layers):
        ks.append(rt.shift_keys(pool.get_key_buffer(layer)[slots], delta_t))
        vs.append(pool.get_value_buffer(layer)[slots])
    return ks, vs, (ids_t, doc_t, pos_t, loc_t, q_t)


@torch.no_grad()
def _selection_queries(rt, q_ids, ctx_k, ctx_v, ctx_ids, ctx_doc, ctx_pos_in_doc, loc, first):
    """Q_que (question rows ``q_ids`` ``[T]`` over the whole anchor context) and each document's local queries
    (its local tokens, context rows ``loc`` ``[L]``, over its own anchor tokens up to themselves), per stable
    layer; no host sync. Rows: the question, then the local tokens; keys: the context, then the rows' own
    (the question rows see the whole context and the question up to themselves, a local row its own document's
    context rows up to itself)."""
    dev = ctx_k[0].device
    c, t = ctx_k[0].shape[0], q_ids.shape[0]
    ids = torch.cat([q_ids, ctx_ids.index_select(0, loc)])
    pos = torch.cat([torch.arange(c, c + t, device=dev), loc])
    n = t + loc.shape[0]
    mask = torch.zeros(n, c + n, dtype=torch.bool, device=dev)
    mask[:t, :c] = True
    mask[:t, c:c + t] = torch.tril(torch.ones(t, t, dtype=torch.bool, device=dev))
    loc_doc = ctx_doc.index_select(0, loc)
    if loc.shape[0]:
        same = loc_doc.unsqueeze(1) == ctx_doc.unsqueeze(0)
        before = ctx_pos_in_doc.unsqueeze(0) <= ctx_pos_in_doc.index_select(0, loc).unsqueeze(1)
        mask[t:, :c] = same & before
    qs, _, _, path = side_rows_forward(rt, ids, pos, ctx_k, ctx_v, mask, first)
    rt.note_path("selection", path)
    return [q[:t] for q in qs], [q[t:] for q in qs], loc_doc


def _tick(rt, name):
    tick = getattr(rt, "tick", None)
    if tick is not None:
        tick(name)


def _to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Many small device tensors to fp32 CPU tensors with one transfer (one host sync, not one per tensor)."""
    if not tensors:
        return []
    shapes = [t.shape for t in tensors]
    host = torch.cat([t.reshape(-1).float() for t in tensors]).cpu()
    return [h.reshape(sh) for h, sh in zip(host.split([sh.numel() for sh in shapes]), shapes)]


def select_blocks(rt, spans, srcs, ids, tree_cache, keep_all: bool = False,
                  cached_at: int = 0) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Kept in-document token positions of each document (sorted), by SamKV's selection (every token when
    ``keep_all``: the CacheBlend-style variant), and per document
    the layer-averaged score of every token against its personalised query (``[n_i]`` fp32, CPU; used to
    pick the recompute set)."""
    cfg = rt.config
    bs = cfg.block_size
    pool = tree_cache.token_to_kv_pool_allocator.get_kvcache()
    n_doc = spans[-1][0] + spans[-1][1]  # end of the documents in ids (they may start after a template prefix)
    # the KV budget in tokens (what kv_kept_ratio reports); the always-kept blocks may take at most
    # anchor_share of it (local blocks trimmed, flashinfer_ext.samkv.score.anchor_layouts), the rest is
    # for the selected middle blocks (flashinfer_ext.samkv.score.kept_budget, also what the front door checks)
    budget_plan = kept_budget([n for _, n in spans], bs, cfg.initial_blocks, cfg.local_blocks,
                              1.0 if keep_all else float(getattr(cfg, "max_kept_ratio", 1.0)),
                              float(getattr(cfg, "anchor_share", 1.0)))
    layouts = list(budget_plan.layouts)
    ctx_k, ctx_v, (ctx_ids, ctx_doc, ctx_pos, local, q_ids) = _gather_context(
        rt, pool, spans, srcs, layouts, bs, ids, cfg.local_query_tokens, ids[n_doc:], cached_at)
    _tick(rt, "select_gather")
    first = max(0, rt.num_layers - cfg.stable_layers)
    mass_layers = cfg.mass_layer_range(rt.num_layers) if cfg.selection == "mass" and not keep_all else range(0)
    lo = min([first] + list(mass_layers[:1]))
    q_rows, q_loc_rows, loc_doc = _selection_queries(rt, q_ids, ctx_k, ctx_v, ctx_ids, ctx_doc, ctx_pos, local, lo)
    q_loc_rows = q_loc_rows[first - lo:]
    q_que = q_rows[first - lo:]
    del ctx_k, ctx_v
    _tick(rt, "select_side_forward")
    d = len(spans)
    q_hats = []
    # local queries per document (index_add, not bincount: bincount on CUDA syncs the host for its size)
    counts = (torch.zeros(d, dtype=torch.int64, device=loc_doc.device).index_add_(0, loc_doc, torch.ones_like(loc_doc))
              .clamp(min=1) if loc_doc.numel() else None)
    for i in range(len(q_que)):
        ql = q_loc_rows[i]
        per_doc = None
        if len(ql):  # per-document mean of its local queries (zeros for a document without any), no host sync
            sums = torch.zeros((d,) + tuple(ql.shape[1:]), dtype=ql.dtype, device=ql.device).index_add_(0, loc_doc, ql)
            per_doc = sums / counts.to(ql.dtype).view(d, *([1] * (ql.dim() - 1)))
        q_hats.append(personalized_queries(generic_query(q_que[i]), per_doc if cfg.personalize else None))
    # every document's keys de-rotated to position 0 (one gather + one rope_shift per stable layer), then
    # every document scored at once per layer (flashinfer_ext.samkv.score.document_scores), one host transfer
    src_all = torch.cat(list(srcs))
    lengths = [n for _, n in spans]
    index = ScoreIndex(lengths, layouts, bs, src_all.device)
    pos_all = index.tok_pos
    p_l, b_l, t_l = [], [], []
    for i, layer in enumerate(range(first, rt.num_layers)):
        k0 = rt.shift_keys(pool.get_key_buffer(layer)[src_all], -pos_all)
        p, blk, tok = document_scores(k0, q_hats[i].to(k0.device), index)
        p_l.append(p)
        b_l.append(blk)
        t_l.append(tok)
    mass = None
    if mass_layers:  # selection="mass": the question's attention mass per block, summed over mass_layers
        tok_mass, scale = 0.0, rt.model.model.layers[0].self_attn.scaling
        for layer in mass_layers:
            k0 = rt.shift_keys(pool.get_key_buffer(layer)[src_all], -pos_all)
            tok_mass = tok_mass + question_token_mass(k0, q_rows[layer - lo], scale)
        mass = [block_mass(tok_mass, index, cfg.mass_spread)]
    p_host, b_host, t_host, *m_host = _to_host([torch.stack(p_l), torch.stack(b_l), torch.stack(t_l).mean(0)]
                                               + (mass or []))
    p_docs = [p_host[:, j] for j in range(d)]                                    # [stable_layers] each
    s_docs = [b_host[:, index.blk_start[j] + mid[0]:index.blk_start[j] + mid[-1] + 1] if mid
              else b_host.new_zeros(b_host.shape[0], 0) for j, (_, _, mid) in enumerate(layouts)]
    scores = list(t_host.split(lengths))
    _tick(rt, "select_scoring")
    if keep_all:
        return [list(range(n)) for _, n in spans], scores
    always_total = sum(len(a) for _, a, _ in layouts)
    total_blocks = sum(nb for nb, _, _ in layouts)
    # middle blocks are full blocks in the max_kept_ratio rule (a short block is always the last, kept as local
    # unless local_blocks is 0; then it is counted as a full one): budget_plan.middle_blocks
    if m_host:
        mass_docs = [m_host[0][index.blk_start[j]:index.blk_start[j] + nb] for j, (nb, _, _) in enumerate(layouts)]
        kept_mid = select_mass_blocks(mass_docs, layouts, budget_plan.middle_blocks)
    else:
        kept_mid = select_middle_blocks(p_docs, s_docs, total_blocks, always_total // max(1, d),
                                        max_middle=budget_plan.middle_blocks)
    out = []
    for (s, n), (nb, always, middle), km in zip(spans, layouts, kept_mid):
        blocks = sorted(set(always) | {middle[j] for j in km})
        out.append([p for b in blocks for p in range(b * bs, min(n, (b + 1) * bs))])
    return out, scores
