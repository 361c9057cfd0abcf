"""SamKV selective recompute (SamKV §3.3, Eq. 4) of the composite context, in the scheduler.

After the composite (kept blocks of every document, keys re-rotated to their new positions) is in the
KV pool, the recompute set R (per document, the top ``recompute_ratio`` of its kept tokens by their
layer-averaged score against the document's personalised query: SamKV's high-attention tokens) is run
through the model again over the *composite*: per layer each recomputed token attends to every composite
token up to its own position, with the fresh K/V of the recomputed tokens in place of their reused
ones, so they gain the cross-document attention their separate prefill lacked. Their new K/V replace
the reused ones (``fuse="overwrite"``) or are blended ``theta * new + (1 - theta) * old`` with
``theta = cos(new, old)`` of the layer's recomputed K (or V) as a whole (``fuse="fusion"``, Eq. 4).

Layer alignment (Fig. 5): selection here is one set per document for all layers (Eq. 3 averages the
stable layers), so R is the same at every layer and rule 1 (a token recomputed at layer n has its
outputs of layers < n computed) holds by running R through every layer; no padding blocks are needed.
Tokens of the composite's sub-page tail are not in R (SGLang extends them with the question anyway).
"""

from __future__ import annotations

import math

import torch

from sglang_sparse.samkv.graph import side_rows_forward


def recompute_set(kept: list[list[int]], scores: list[torch.Tensor], ratio: float, limit: int) -> list[int]:
    """Composite indices (sorted) of the tokens to recompute: per document the top ``ceil(ratio * kept)``
    kept tokens by score; only indices ``< limit`` (the page-aligned composite)."""
    out, base = [], 0
    for kp, sc in zip(kept, scores):
        m = math.ceil(ratio * len(kp) - 1e-9)
        if m > 0:
            s = sc[torch.as_tensor(kp, dtype=torch.int64)]
            top = torch.topk(s, min(m, len(kp))).indices.tolist()
            out += [base + j for j in top if base + j < limit]
        base += len(kp)
    return sorted(out)


def fuse_kv(new: torch.Tensor, old: torch.Tensor, mode: str) -> torch.Tensor:
    """Eq. 4 on ``[R, kv_heads, head_dim]``: ``overwrite`` -> new; ``fusion`` -> theta*new + (1-theta)*old with
    one ``theta = cos(new, old)`` of the whole tensors (this layer's recomputed K, or V), clamped to [0, 1]
    (fp32 maths, result in ``old``'s dtype). A per-token theta was tried first: on SmolLM2-135M it turned
    the answers of the planted-fact tasks into gibberish (tokens with small or negative cosines get
    extrapolated or mostly-old states), the whole-tensor theta (the paper: "typically around 0.9") did not."""
    return fuse_kv_layers(new.unsqueeze(0), old.unsqueeze(0), mode)[0]


def fuse_kv_layers(new: torch.Tensor, old: torch.Tensor, mode: str) -> torch.Tensor:
    """:func:`fuse_kv` of every layer at once: ``new`` / ``old`` ``[layers, R, kv_heads, head_dim]``, one theta
    per layer."""
    if mode == "overwrite":
        return new.to(old.dtype)
    n, o = new.float().flatten(1), old.float().flatten(1)
    theta = torch.nn.functional.cosine_similarity(n, o, dim=-1).clamp(0.0, 1.0).unsqueeze(1)   # [layers, 1]
    return (theta * n + (1.0 - theta) * o).to(old.dtype).view(old.shape)


@torch.no_grad()
def recompute(rt, pool, dst: torch.Tensor, comp_ids: list[int], r_idx: list[int], mode: str) -> None:
    """Recompute the composite rows ``r_idx`` (composite slots ``dst`` ``[K]``, token ids ``comp_ids``) in
    place in the pool, all layers. The side forward's attention reads the gathered context (with the rows'
    fresh K/V), never the pool, so the rows' K/V of all layers are fused and written after it in a few
    batched kernels (not ~30 small ones per layer)."""
    if not r_idx:
        return
    dev = dst.device
    r, ids = torch.tensor(list(r_idx) + [comp_ids[i] for i in r_idx], dtype=torch.int64).to(dev).split(len(r_idx))
    ctx_k = [pool.get_key_buffer(layer)[dst] for layer in range(rt.num_layers)]
    ctx_v = [pool.get_value_buffer(layer)[dst] for layer in range(rt.num_layers)]
    rows = dst[r]
    # each recomputed row sees the composite up to itself with the reused rows of the set hidden and their fresh
    # K/V (appended after the composite) shown instead
    hidden = torch.zeros(len(dst), dtype=torch.bool, device=dev).index_fill_(0, r, True)
    before = torch.arange(len(dst), device=dev).unsqueeze(0) <= r.unsqueeze(1)
    mask = torch.cat([before & ~hidden.unsqueeze(0), r.unsqueeze(0) <= r.unsqueeze(1)], dim=1)
    _, new_k, new_v, path = side_rows_forward(rt, ids, r, ctx_k, ctx_v, mask, rt.num_layers)
    rt.note_path("recompute", path)
    fused_k = fuse_kv_layers(new_k, torch.stack([x.index_select(0, r) for x in ctx_k]), mode)
    fused_v = fuse_kv_layers(new_v, torch.stack([x.index_select(0, r) for x in ctx_v]), mode)
    for layer in range(rt.num_layers):
        pool.get_key_buffer(layer)[rows] = fused_k[layer]
        pool.get_value_buffer(layer)[rows] = fused_v[layer]
