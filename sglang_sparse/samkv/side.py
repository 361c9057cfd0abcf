"""SamKV's side forward: rows run through the model's own modules (embedding, norms, QKV / O projections, RoPE,
MLP) layer by layer, with the attention over a given context computed here in torch. Used by the block selection
(:mod:`sglang_sparse.samkv.select`) and the recompute, eagerly or captured in CUDA graphs
(:mod:`sglang_sparse.samkv.graph`).

Cautions: Llama-style decoder stacks only (``model.model.layers[i].self_attn.qkv_proj`` etc.); other models raise
and the request is served densely.
"""

from __future__ import annotations

import torch


def side_forward(rt, ids: torch.Tensor, pos: torch.Tensor, ctx_k, ctx_v, mask: torch.Tensor, *,
                 first_layer: int | None = None, on_layer=None) -> list[torch.Tensor]:
    """Run ``R`` rows (token ``ids`` ``[R]`` at positions ``pos`` ``[R]``) through the model's layers with the
    attention computed here: per layer the keys/values are the context ``ctx_k[l]`` / ``ctx_v[l]``
    ``[C, kv_heads, head_dim]`` (post-RoPE keys) followed by every row's own fresh K/V in row order; ``mask``
    bool ``[R, C + R]`` says which keys each row sees (a recomputed row hides its reused context row and sees
    its fresh one instead: keys carry RoPE, so where a key sits in the list does not matter).
    ``on_layer(layer_id, k, v)`` gets the rows' fresh post-RoPE ``k``/``v`` ``[R, kv_heads, head_dim]``.
    Returns the rows' pre-RoPE queries ``[R, q_heads, head_dim]`` fp32 of layers ``first_layer ..``. Shapes are
    static for fixed ``R``/``C`` and nothing syncs the host: :mod:`sglang_sparse.samkv.graph` captures it."""
    inner = rt.model.model
    r = ids.shape[0]
    h = inner.embed_tokens(ids)
    # side_attention="model": q/k/v in the model's dtype on CUDA (the memory-efficient kernel: fp32 softmax
    # and accumulation inside, as the serving kernels); fp32 otherwise (CPU's bf16 SDPA rounds the softmax
    # itself: it moved a full recompute's first-token log-probs 0.2 from dense, tests/test_samkv_recompute.py)
    model_dtype = getattr(getattr(rt, "config", None), "side_attention", "fp32") == "model" and h.is_cuda
    residual, out = None, []
    for layer_id, layer in enumerate(inner.layers):
        if residual is None:
            residual, h = h, layer.input_layernorm(h)
        else:
            h, residual = layer.input_layernorm(h, residual)
        a = layer.self_attn
        qkv, _ = a.qkv_proj(h)
        q, k, v = qkv.split([a.q_size, a.kv_size, a.kv_size], dim=-1)
        if first_layer is not None and layer_id >= first_layer:
            out.append(q.reshape(r, a.num_heads, a.head_dim).float().clone())
        q, k = a.rotary_emb(pos, q.contiguous(), k.contiguous())
        k = k.reshape(r, a.num_kv_heads, a.head_dim)
        v = v.reshape(r, a.num_kv_heads, a.head_dim)
        kk, vv = torch.cat([ctx_k[layer_id].to(k.dtype), k]), torch.cat([ctx_v[layer_id].to(v.dtype), v])
        if on_layer is not None:
            on_layer(layer_id, k, v)
        o = _attend(q.reshape(r, a.num_heads, a.head_dim), kk, vv, mask, a.scaling, model_dtype)
        h, _ = a.o_proj(o.reshape(r, a.q_size).to(h.dtype))
        h, residual = layer.post_attention_layernorm(h, residual)
        h = layer.mlp(h)
    return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
            model_dtype: bool) -> torch.Tensor:
    """Masked attention of ``q`` ``[R, q_heads, dim]`` over ``k`` / ``v`` ``[C, kv_heads, dim]`` (``mask`` bool
    ``[R, C]``) -> ``[R, q_heads, dim]``. fp32 (SDPA, KV heads shared by their group through ``enable_gqa``),
    or (``model_dtype``, CUDA) ``q``/``k``/``v`` kept in their dtype with the KV heads expanded, on SDPA's
    memory-efficient kernel only (no silent fallback to a bf16 math path)."""
    hq, hkv = q.shape[1], k.shape[1]
    if model_dtype:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        g = hq // hkv
        kx = k.repeat_interleave(g, dim=1) if g > 1 else k
        vx = v.repeat_interleave(g, dim=1) if g > 1 else v
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            o = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1).unsqueeze(0), kx.transpose(0, 1).unsqueeze(0).to(q.dtype),
                vx.transpose(0, 1).unsqueeze(0).to(q.dtype), attn_mask=mask, scale=scale)
        return o[0].transpose(0, 1)
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0).float(), k.transpose(0, 1).unsqueeze(0).float(),
        v.transpose(0, 1).unsqueeze(0).float(), attn_mask=mask, scale=scale, enable_gqa=hq != hkv)
    return o[0].transpose(0, 1)
