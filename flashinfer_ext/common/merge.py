"""Merging partial attention states by their base-2 log-sum-exp.

Supports: ``(v, s)`` pairs with ``v`` ``[n, num_heads, head_dim]`` and ``s`` ``[n, num_heads]``
fp32 base-2 lse (FlashInfer's ``return_lse`` convention and :func:`flashinfer_ext.common.sparse_decode.sparse_decode`'s
output); on CUDA with FlashInfer installed it calls ``flashinfer.merge_state``,
elsewhere an equivalent torch implementation.

Cautions: flashinfer is imported lazily (it is not installed on CPU machines);
``lse = -inf`` marks an empty state and merges as weight 0.
"""

from __future__ import annotations

import torch

__all__ = ["merge_state"]


def _torch_merge(v_a, s_a, v_b, s_b):
    s = torch.logaddexp2(s_a.float(), s_b.float())
    safe = torch.where(torch.isinf(s), torch.zeros_like(s), s)
    w_a = torch.exp2(s_a.float() - safe)[..., None]
    w_b = torch.exp2(s_b.float() - safe)[..., None]
    return (v_a.float() * w_a + v_b.float() * w_b).to(v_a.dtype), s


def merge_state(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor,
                use_flashinfer: bool | None = None):
    """Merge two states; returns ``(v [n, num_heads, head_dim] in v_a's dtype, s [n, num_heads] fp32)``."""
    if use_flashinfer is None:
        use_flashinfer = v_a.is_cuda
    if use_flashinfer:
        import flashinfer  # lazy: GPU machines only

        return flashinfer.merge_state(v_a, s_a.float(), v_b, s_b.float())
    return _torch_merge(v_a, s_a, v_b, s_b)
