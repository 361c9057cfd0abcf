"""Re-rotate cached (post-RoPE) keys by a RoPE position delta: the SamKV document-reuse step.

A document's KV is prefilled alone at positions ``[0, n)``; placed at offset ``o`` in a request its
keys must be the keys at ``[o, o + n)``. RoPE rotates each pair of key dimensions by ``pos * inv_freq``,
and rotations compose, so ``R(p + o) k = R(o) (R(p) k)``: shifting the cached key by ``R(delta)``
reproduces the key computed at the new position up to rounding. Values carry no RoPE and are reused
as they are.

Supports:
  * Llama-style RoPE in the NeoX / rotate-half layout (HF ``LlamaRotaryEmbedding`` +
    ``apply_rotary_pos_emb``; SGLang ``get_rope(..., is_neox_style=True)``, the Llama default):
    dimension ``i`` of the rotary part pairs with ``i + rotary_dim // 2``,
    ``inv_freq[i] = 1 / rope_theta ** (2 i / rotary_dim)`` computed in fp32 as SGLang and HF do.
  * Partial rotary (``rotary_dim < head_dim``): the first ``rotary_dim`` dims rotate, the rest pass
    through unchanged (SGLang's ``forward_native`` convention).
  * Keys ``[num_tokens, num_kv_heads, head_dim]`` in bf16 / fp16 / fp32 (last dim contiguous, other
    strides free), one delta for all tokens (python int) or one per token (integer tensor
    ``[num_tokens]``), positive, zero or negative. The rotation is computed in fp32 and rounded
    once to the key dtype.
  * ``rope_shift``: one Triton launch (runs under ``TRITON_INTERPRET=1`` on CPU);
    ``rope_shift_reference``: the pure-torch fp32 reference it is tested against.

Not supported (refuse these models upstream, the maths differs): GPT-J / interleaved layout
(``is_neox_style=False``), rope scalings that make the rotation depend on the absolute position or
the sequence length (``dynamic`` NTK, ``longrope`` with short/long factors, ``yarn`` attention
scaling of the cos/sin magnitude, ``mrope`` multimodal sections, Llama-4 chunked / no-RoPE layers).
Frequency-only scalings (``linear``, ``llama3``) only change ``inv_freq``; pass ``inv_freq``
explicitly to use them (the caller must derive it exactly as the model does).

Cautions: the angle ``delta * inv_freq`` is formed in fp32 (as SGLang forms ``pos * inv_freq``), so
its absolute error grows like ``|delta| * 6e-8`` rad on the fastest pair (1e-3 rad at delta 16k,
below bf16 resolution). Re-rotating a bf16 key rounds it a second time, so a shifted key differs from
a freshly computed one by up to about two bf16 ulps of the key's pair magnitude.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

__all__ = ["rope_inv_freq", "rope_shift", "rope_shift_reference"]

_KEY_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def rope_inv_freq(rope_theta: float, rotary_dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``inv_freq`` fp32 ``[rotary_dim // 2]`` exactly as SGLang's ``RotaryEmbedding._compute_inv_freq``
    (and HF Llama's default rope init) compute it: ``1 / theta ** (arange(0, rd, 2) / rd)`` in fp32."""
    if isinstance(rope_theta, bool) or not isinstance(rope_theta, (int, float)) \
            or not math.isfinite(rope_theta) or rope_theta <= 1.0:
        raise ValueError(f"rope_theta={rope_theta!r} is out of range: expected a finite number > 1")
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int) or rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim={rotary_dim!r} is out of range: expected a positive even integer")
    exps = torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim
    return (1.0 / (rope_theta ** exps)).to(device)


def _check(k: torch.Tensor, delta, rope_theta, rotary_dim, inv_freq):
    """Validate inputs; return (delta int64 [num_tokens] on k.device, inv_freq fp32 [rd/2], rd)."""
    if not isinstance(k, torch.Tensor) or k.dim() != 3:
        raise ValueError(f"k must be a tensor [num_tokens, num_kv_heads, head_dim], got "
                         f"{tuple(k.shape) if isinstance(k, torch.Tensor) else type(k).__name__}")
    if k.dtype not in _KEY_DTYPES:
        raise ValueError(f"k.dtype={k.dtype} is not supported: expected one of {_KEY_DTYPES}")
    n, _, head_dim = k.shape
    rd = head_dim if rotary_dim is None else rotary_dim
    if isinstance(rd, bool) or not isinstance(rd, int) or not 0 < rd <= head_dim or rd % 2:
        raise ValueError(f"rotary_dim={rotary_dim!r} is out of range: expected an even integer in "
                         f"[2, head_dim={head_dim}]")
    if inv_freq is None:
        inv_freq = rope_inv_freq(rope_theta, rd, k.device)
    else:
        if inv_freq.shape != (rd // 2,):
            raise ValueError(f"inv_freq shape {tuple(inv_freq.shape)} != (rotary_dim // 2,) = ({rd // 2},)")
        inv_freq = inv_freq.to(device=k.device, dtype=torch.float32)
    if isinstance(delta, bool):
        raise ValueError("delta must be an int or an integer tensor [num_tokens], got a bool")
    if isinstance(delta, int):
        d = torch.full((n,), delta, dtype=torch.int64, device=k.device)
    elif isinstance(delta, torch.Tensor):
        if delta.dtype.is_floating_point or delta.dtype.is_complex or delta.dtype == torch.bool:
            raise ValueError(f"delta.dtype={delta.dtype}: expected an integer tensor")
        if delta.shape == ():
            d = delta.to(device=k.device, dtype=torch.int64).expand(n).contiguous()
        elif delta.shape == (n,):
            d = delta.to(device=k.device, dtype=torch.int64).contiguous()
        else:
            raise ValueError(f"delta shape {tuple(delta.shape)} != (num_tokens,) = ({n},)")
    else:
        raise ValueError(f"delta must be an int or an integer tensor [num_tokens], got {type(delta).__name__}")
    return d, inv_freq.contiguous(), rd


def rope_shift_reference(k: torch.Tensor, delta: int | torch.Tensor, *, rope_theta: float,
                         rotary_dim: int | None = None, inv_freq: torch.Tensor | None = None) -> torch.Tensor:
    """Pure-torch fp32 reference of :func:`rope_shift`.

    k ``[num_tokens, num_kv_heads, head_dim]`` bf16/fp16/fp32 (keys after RoPE at some positions);
    delta python int or integer ``[num_tokens]``. Returns a new tensor, same shape and dtype: keys as if
    RoPE had been applied at ``position + delta``. ``inv_freq`` fp32 ``[rotary_dim // 2]`` overrides
    the one derived from ``rope_theta`` (frequency-only scalings).
    """
    d, inv, rd = _check(k, delta, rope_theta, rotary_dim, inv_freq)
    half = rd // 2
    ang = d.to(torch.float32)[:, None] * inv[None, :]  # [n, half], fp32 like SGLang's cos/sin cache
    cos = ang.cos()[:, None, :]
    sin = ang.sin()[:, None, :]
    kf = k.float()
    x1, x2 = kf[..., :half], kf[..., half:rd]
    out = kf.clone()
    out[..., :half] = x1 * cos - x2 * sin
    out[..., half:rd] = x2 * cos + x1 * sin
    return out.to(k.dtype)


@triton.jit
def _rope_shift_kernel(
    k_ptr, stride_kt, stride_kh,
    out_ptr, stride_ot, stride_oh,
    delta_ptr, inv_freq_ptr,
    num_heads,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    i = tl.arange(0, HALF_PAD)
    hmask = h < num_heads
    imask = i < HALF
    mask = hmask[:, None] & imask[None, :]

    delta = tl.load(delta_ptr + t).to(tl.float32)
    inv = tl.load(inv_freq_ptr + i, mask=imask, other=0.0)
    ang = delta * inv
    c = tl.cos(ang)[None, :]
    s = tl.sin(ang)[None, :]

    base_k = k_ptr + t * stride_kt + h[:, None].to(tl.int64) * stride_kh + i[None, :]
    x1 = tl.load(base_k, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base_k + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * c - x2 * s
    o2 = x2 * c + x1 * s
    base_o = out_ptr + t * stride_ot + h[:, None].to(tl.int64) * stride_oh + i[None, :]
    tl.store(base_o, o1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(base_o + HALF, o2.to(out_ptr.dtype.element_ty), mask=mask)


def rope_shift(k: torch.Tensor, delta: int | torch.Tensor, *, rope_theta: float,
               rotary_dim: int | None = None, inv_freq: torch.Tensor | None = None) -> torch.Tensor:
    """Re-rotate post-RoPE keys by ``delta`` positions (Triton; fp32 rotation).

    Args:
      k: ``[num_tokens, num_kv_heads, head_dim]`` bf16/fp16/fp32, last dim contiguous; keys after
        NeoX-layout RoPE at some positions ``p``.
      delta: python int (same shift for every token) or integer tensor ``[num_tokens]`` (any sign).
      rope_theta: the model's RoPE base (``rope_theta``; SmolLM2: 100000).
      rotary_dim: rotated leading dims (even, <= head_dim); default ``head_dim``.
      inv_freq: optional fp32 ``[rotary_dim // 2]`` overriding the default frequencies.

    Returns a new contiguous tensor, same shape/dtype/device as ``k``: the keys at ``p + delta``.
    """
    d, inv, rd = _check(k, delta, rope_theta, rotary_dim, inv_freq)
    if k.stride(-1) != 1:
        k = k.contiguous()
    out = k.clone(memory_format=torch.contiguous_format)  # pass-through dims beyond rotary_dim
    n, h, _ = k.shape
    if n == 0 or h == 0:
        return out
    half = rd // 2
    block_h = min(triton.next_power_of_2(h), 16)
    grid = (n, triton.cdiv(h, block_h))
    _rope_shift_kernel[grid](
        k, k.stride(0), k.stride(1),
        out, out.stride(0), out.stride(1),
        d, inv, h,
        HALF=half, HALF_PAD=triton.next_power_of_2(half), BLOCK_H=block_h,
    )
    return out
