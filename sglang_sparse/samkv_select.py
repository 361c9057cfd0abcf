"""SamKV block selection inside the scheduler (variant ``samkv``): which blocks of each document the
composite context keeps (SamKV §3.1-3.2; maths in :mod:`flashinfer_ext.samkv_score`).

1. Anchor context: the tokens of every document's initial + local blocks, their cached KV gathered from
   the pool, keys re-rotated to consecutive positions ``0 .. C-1`` (all layers).
2. Side forward of the question (the request's prompt tokens after the documents) over that context:
   the model's own modules (embedding, norms, QKV / O projections, RoPE, MLP) layer by layer, with the
   attention computed here in torch (each question token sees the whole anchor context and the
   question tokens up to itself). Only the question's queries are kept: the pre-RoPE queries of the
   last ``stable_layers`` layers, mean-pooled = ``Q_que`` per layer. Its KV is thrown away; the
   question is prefilled again by SGLang over the selected context (SamKV's "re-perform an
   incremental prefill of the user query").
3. Per stable layer and document: keys de-rotated to position 0, mean key per block, Eq. 1-3, then
   the cross-document budget (:func:`flashinfer_ext.samkv_score.select_middle_blocks`).

Departure (stated in the README): SGLang keeps no Q cache, so the documents' local queries
``Q_doc-j,loc`` of Eq. 1 are not available; ``Q^_i = Q_que`` (the paper's "no personalised bias"
ablation). Supports Llama-style decoder stacks (``model.model.layers[i].self_attn.qkv_proj`` etc.);
other models raise and the request is served densely.
"""

from __future__ import annotations

import torch

from flashinfer_ext.samkv_score import (anchor_top_p, block_layout, block_mean_keys, block_scores,
                                        generic_query, personalized_queries, select_middle_blocks)


def _gather_context(rt, pool, spans, srcs, layouts, bs):
    """Per layer ``(K, V)`` of the anchor context ``[C, kv_heads, head_dim]`` at positions ``0..C-1``."""
    slots, delta, pos = [], [], 0
    for (s, n), src, (nb, always, _) in zip(spans, srcs, layouts):
        tok = torch.cat([torch.arange(b * bs, min(n, (b + 1) * bs)) for b in always]) if always else \
            torch.zeros(0, dtype=torch.int64)
        slots.append(src[tok.to(src.device)])
        delta.append(torch.arange(pos, pos + len(tok)) - tok)
        pos += len(tok)
    slots = torch.cat(slots)
    delta = torch.cat(delta).to(slots.device)
    ks, vs = [], []
    for layer in range(rt.num_layers):
        ks.append(rt.shift_keys(pool.get_key_buffer(layer)[slots], delta))
        vs.append(pool.get_value_buffer(layer)[slots])
    return ks, vs


@torch.no_grad()
def question_queries(rt, question_ids: list[int], ctx_k, ctx_v, first_layer: int) -> list[torch.Tensor]:
    """Side forward of the question over the context; returns pre-RoPE queries ``[T, q_heads, head_dim]``
    fp32 of layers ``first_layer ..`` (one tensor per layer)."""
    inner = rt.model.model
    dev = ctx_k[0].device
    c, t = ctx_k[0].shape[0], len(question_ids)
    pos = torch.arange(c, c + t, device=dev)
    mask = torch.ones(t, c + t, dtype=torch.bool, device=dev)
    mask[:, c:] = torch.tril(torch.ones(t, t, dtype=torch.bool, device=dev))
    h = inner.embed_tokens(torch.tensor(question_ids, device=dev))
    residual, out = None, []
    for layer_id, layer in enumerate(inner.layers):
        if residual is None:
            residual, h = h, layer.input_layernorm(h)
        else:
            h, residual = layer.input_layernorm(h, residual)
        a = layer.self_attn
        qkv, _ = a.qkv_proj(h)
        q, k, v = qkv.split([a.q_size, a.kv_size, a.kv_size], dim=-1)
        if layer_id >= first_layer:
            out.append(q.reshape(t, a.num_heads, a.head_dim).float().clone())
        q, k = a.rotary_emb(pos, q.contiguous(), k.contiguous())
        group = a.num_heads // a.num_kv_heads
        kk = torch.cat([ctx_k[layer_id].to(k.dtype), k.reshape(t, a.num_kv_heads, a.head_dim)])
        vv = torch.cat([ctx_v[layer_id].to(v.dtype), v.reshape(t, a.num_kv_heads, a.head_dim)])
        qh = q.reshape(t, a.num_heads, a.head_dim).transpose(0, 1).float()
        kh = kk.repeat_interleave(group, dim=1).transpose(0, 1).float()
        vh = vv.repeat_interleave(group, dim=1).transpose(0, 1).float()
        o = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=a.scaling)
        h, _ = a.o_proj(o.transpose(0, 1).reshape(t, a.q_size).to(h.dtype))
        h, residual = layer.post_attention_layernorm(h, residual)
        h = layer.mlp(h)
    return out


def select_blocks(rt, spans, srcs, ids, tree_cache) -> list[list[int]]:
    """Kept in-document token positions of each document (sorted), by SamKV's selection."""
    cfg = rt.config
    bs = cfg.block_size
    pool = tree_cache.token_to_kv_pool_allocator.get_kvcache()
    layouts = [block_layout(n, bs, cfg.initial_blocks, cfg.local_blocks) for _, n in spans]
    n_doc = spans[-1][0] + spans[-1][1]
    if all(not mid for _, _, mid in layouts):
        return [list(range(n)) for _, n in spans]
    ctx_k, ctx_v = _gather_context(rt, pool, spans, srcs, layouts, bs)
    first = max(0, rt.num_layers - cfg.stable_layers)
    queries = question_queries(rt, list(ids[n_doc:]), ctx_k, ctx_v, first)
    del ctx_k, ctx_v
    p_docs, s_docs = [], []
    for (s, n), src, (nb, always, middle) in zip(spans, srcs, layouts):
        p_l, s_l = [], []
        for i, layer in enumerate(range(first, rt.num_layers)):
            q_hat = personalized_queries(generic_query(queries[i]), None)[0]
            k0 = rt.shift_keys(pool.get_key_buffer(layer)[src], -torch.arange(n, device=src.device))
            means = block_mean_keys(k0, bs)                                     # [nb, kv_heads, dim]
            anchor = torch.cat([k0[b * bs:(b + 1) * bs] for b in always]).float().mean(0, keepdim=True)
            s_mid = block_scores(q_hat.to(means.device), means[middle]) if middle else means.new_zeros(0)
            s_anc = block_scores(q_hat.to(means.device), anchor)
            p_l.append(anchor_top_p(s_anc, s_mid.unsqueeze(0))[0])
            s_l.append(s_mid)
        p_docs.append(torch.stack(p_l).cpu())
        s_docs.append(torch.stack(s_l).cpu())
    always_total = sum(len(a) for _, a, _ in layouts)
    total_blocks = sum(nb for nb, _, _ in layouts)
    kept_mid = select_middle_blocks(p_docs, s_docs, total_blocks, always_total // max(1, len(spans)))
    out = []
    for (s, n), (nb, always, middle), km in zip(spans, layouts, kept_mid):
        blocks = sorted(set(always) | {middle[j] for j in km})
        out.append([p for b in blocks for p in range(b * bs, min(n, (b + 1) * bs))])
    return out
