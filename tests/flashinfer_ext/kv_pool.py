"""Synthetic SGLang-style KV pools for the kernel tests (no sglang import)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import torch


@dataclass
class Pool:
    q: torch.Tensor              # [batch, num_qo_heads, head_dim]
    k_buffer: torch.Tensor       # [num_slots, num_kv_heads, head_dim]
    v_buffer: torch.Tensor
    req_to_token: torch.Tensor   # [max_reqs, max_context_len] int32
    req_pool_indices: torch.Tensor  # [batch] int32
    seq_lens: torch.Tensor       # [batch] int32
    page_size: int

    @property
    def sm_scale(self) -> float:
        return self.q.shape[-1] ** -0.5


def make_pool(seq_lens, num_qo_heads, num_kv_heads, head_dim, dtype, page_size, *, seed=0,
              device="cpu", planted=False, max_context_len=None, spare_reqs=2) -> Pool:
    """Random pool: requests live at shuffled ``req_to_token`` rows; pages (or slots) shuffled.

    ``planted``: keys carry a power-law attention structure over 16-token groups (a few
    groups align strongly with the query) so sparse decode has something to find.
    """
    g = torch.Generator().manual_seed(seed)
    batch = len(seq_lens)
    max_len = max_context_len or max(seq_lens)
    max_reqs = batch + spare_reqs
    p = max(page_size, 1)
    pages_per_req = -(-max_len // p)
    num_pages = max_reqs * pages_per_req + 3
    perm = torch.randperm(num_pages, generator=g)
    req_to_token = torch.zeros(max_reqs, pages_per_req * p, dtype=torch.int32)
    rows = torch.randperm(max_reqs, generator=g)[:batch]
    for i in range(max_reqs):
        pages = perm[i * pages_per_req:(i + 1) * pages_per_req]
        req_to_token[i] = (pages[:, None] * p + torch.arange(p)[None, :]).reshape(-1).to(torch.int32)
    if page_size == 1:  # no pages: slots fully shuffled
        req_to_token = torch.randperm(num_pages, generator=g)[: max_reqs * max_len].view(max_reqs, max_len)
        req_to_token = req_to_token.to(torch.int32)
    num_slots = num_pages * p
    k = torch.randn(num_slots, num_kv_heads, head_dim, generator=g)
    v = torch.randn(num_slots, num_kv_heads, head_dim, generator=g)
    q = torch.randn(batch, num_qo_heads, head_dim, generator=g)
    if planted:
        group = num_qo_heads // num_kv_heads
        for r, L in enumerate(seq_lens):
            slots = req_to_token[rows[r], :L].long()
            n_groups = -(-L // 16)
            # power-law strength per 16-token group, random order
            strength = 1.0 / (1.0 + torch.randperm(n_groups, generator=g).float()) ** 1.2
            for h in range(num_kv_heads):
                qdir = q[r, h * group:(h + 1) * group].mean(0)
                qdir = qdir / qdir.norm()
                tok_strength = strength.repeat_interleave(16)[:L]
                k[slots, h] = 0.3 * k[slots, h] + (6.0 * math.sqrt(head_dim) ** 0.5) * tok_strength[:, None] * qdir
    return Pool(q=q.to(dtype).to(device), k_buffer=k.to(dtype).to(device), v_buffer=v.to(dtype).to(device),
                req_to_token=req_to_token.to(device), req_pool_indices=rows.to(torch.int32).to(device),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device), page_size=page_size)


def layered_backend(pool: Pool, num_layers: int, seed: int):
    """SGLang-shaped stand-in of an attention backend over ``pool``: layer 0 reads the pool's keys and values,
    the other layers random ones (``[num_slots, num_kv_heads, head_dim]`` each, drawn from ``seed``). Returns
    ``(backend, generator)``; the generator goes on to draw the test's queries."""
    g = torch.Generator().manual_seed(seed)
    k_bufs = [pool.k_buffer] + [torch.randn(pool.k_buffer.shape, generator=g) for _ in range(num_layers - 1)]
    v_bufs = [pool.v_buffer] + [torch.randn(pool.v_buffer.shape, generator=g) for _ in range(num_layers - 1)]
    backend = SimpleNamespace(
        token_to_kv_pool=SimpleNamespace(get_key_buffer=lambda i: k_bufs[i], get_value_buffer=lambda i: v_bufs[i]),
        req_to_token_pool=SimpleNamespace(req_to_token=pool.req_to_token))
    return backend, g
