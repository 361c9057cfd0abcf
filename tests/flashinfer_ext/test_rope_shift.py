"""rope_shift: Triton kernel == fp32 torch reference, and the SamKV exactness contract on real weights.

The contract: SmolLM2-135M's layer-0 keys of a text computed at positions [0, n) and
re-rotated by o equal the keys computed at positions [o, o + n), within bf16 tolerance. Layer-0 keys
depend on position only through RoPE, so the contract is exact up to rounding; a shift by o + 1 is the
negative control that shows the tolerance has teeth.
"""

from __future__ import annotations

import os

import pytest
import torch

from flashinfer_ext.samkv.rope_shift import rope_inv_freq, rope_shift, rope_shift_reference

MODEL_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "models", "SmolLM2-135M-Instruct")


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over the max |b| (fp32)."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [1, 3, 8])
def test_kernel_matches_reference(head_dim, dtype, heads):
    g = torch.Generator().manual_seed(head_dim * 100 + heads)
    n = 13
    k = torch.randn(n, heads, head_dim, generator=g).to(dtype)
    per_token = torch.randint(-5000, 5000, (n,), generator=g)
    for delta in (0, 7, -3, 4096, per_token):
        ref = rope_shift_reference(k, delta, rope_theta=10000.0)
        out = rope_shift(k, delta, rope_theta=10000.0)
        assert out.shape == k.shape and out.dtype == dtype
        # same fp32 maths, one rounding each: at most one ulp apart
        torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2)
        if isinstance(delta, int) and delta == 0:
            assert torch.equal(out, k)


def test_partial_rotary_and_strided_input():
    g = torch.Generator().manual_seed(1)
    base = torch.randn(9, 4, 128, generator=g).to(torch.bfloat16)
    k = base[:, ::2, :]  # non-contiguous heads
    out = rope_shift(k, 11, rope_theta=500000.0, rotary_dim=64)
    ref = rope_shift_reference(k, 11, rope_theta=500000.0, rotary_dim=64)
    torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2)
    assert torch.equal(out[..., 64:], k[..., 64:])


def test_shift_composes_and_inverts_fp32():
    g = torch.Generator().manual_seed(2)
    k = torch.randn(17, 3, 64, generator=g)
    there = rope_shift(k, 300, rope_theta=100000.0)
    back = rope_shift(there, -300, rope_theta=100000.0)
    torch.testing.assert_close(back, k, rtol=0, atol=1e-4)
    two = rope_shift(rope_shift(k, 100, rope_theta=100000.0), 200, rope_theta=100000.0)
    torch.testing.assert_close(two, there, rtol=0, atol=1e-4)
    # norms per rotated pair are preserved
    torch.testing.assert_close(there.norm(dim=-1), k.norm(dim=-1), rtol=1e-5, atol=1e-5)


def test_bad_inputs_name_the_field():
    k = torch.zeros(4, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="rotary_dim"):
        rope_shift(k, 1, rope_theta=1e4, rotary_dim=63)
    with pytest.raises(ValueError, match="rope_theta"):
        rope_shift(k, 1, rope_theta=float("nan"))
    with pytest.raises(ValueError, match="delta"):
        rope_shift(k, torch.zeros(3, dtype=torch.int64), rope_theta=1e4)
    with pytest.raises(ValueError, match="delta"):
        rope_shift(k, torch.zeros(4), rope_theta=1e4)
    with pytest.raises(ValueError, match="k.dtype"):
        rope_shift(k.to(torch.int32), 1, rope_theta=1e4)
    with pytest.raises(ValueError, match="k must be"):
        rope_shift(k[0], 1, rope_theta=1e4)
    assert rope_shift(k[:0], 5, rope_theta=1e4).shape == (0, 2, 64)


# ---------------------------------------------------------------- real weights (SmolLM2-135M)


@pytest.fixture(scope="module")
def smollm2():
    transformers = pytest.importorskip("transformers")
    if not os.path.isdir(MODEL_DIR):
        pytest.skip(f"model not found at {MODEL_DIR}")
    tok = transformers.AutoTokenizer.from_pretrained(MODEL_DIR)
    model = transformers.AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.bfloat16)
    model.eval()
    text = ("Document 3: The lighthouse keeper logged every ship that passed the northern cape, "
            "and in the winter of 1891 he counted forty-two schooners and a single steamer.")
    ids = tok(text, return_tensors="pt").input_ids
    return model, ids


def _layer0_keys(model, ids: torch.Tensor, start: int, rope_dtype: torch.dtype) -> torch.Tensor:
    """Layer-0 keys after RoPE at positions [start, start + n): ``[n, num_kv_heads, head_dim]``.

    HF's own path: embeddings -> input_layernorm -> k_proj (bf16 weights) -> HF rotary embedding ->
    ``apply_rotary_pos_emb``; ``rope_dtype`` is the dtype RoPE is applied in (bf16 = as HF serves it).
    """
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cfg = model.config
    layer = model.model.layers[0]
    n = ids.shape[1]
    with torch.no_grad():
        h = layer.input_layernorm(model.model.embed_tokens(ids))
        k = layer.self_attn.k_proj(h).view(1, n, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        k = k.to(rope_dtype)
        pos = torch.arange(start, start + n)[None]
        cos, sin = model.model.rotary_emb(k, pos)
        _, k_rot = apply_rotary_pos_emb(k, k, cos, sin)
    return k_rot[0].transpose(0, 1).contiguous()  # [n, kv_heads, head_dim]


def _rope_theta(model) -> float:
    cfg = model.config
    params = getattr(cfg, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))


def test_inv_freq_matches_hf(smollm2):
    model, _ = smollm2
    hf = model.model.rotary_emb.inv_freq.float()
    torch.testing.assert_close(rope_inv_freq(_rope_theta(model), model.config.head_dim), hf, rtol=0, atol=0)


@pytest.mark.parametrize("offset", [1, 37, 1000, 6000])
def test_reused_keys_equal_keys_at_offset_fp32(smollm2, offset):
    model, ids = smollm2
    theta = _rope_theta(model)
    k0 = _layer0_keys(model, ids, 0, torch.float32)
    ko = _layer0_keys(model, ids, offset, torch.float32)
    shifted = rope_shift(k0, offset, rope_theta=theta)
    # both sides form the angle in fp32: |error| ~ (offset) * 6e-8 rad relative to the pair magnitude
    assert _max_rel(shifted, ko) < 5e-4  # measured 1e-4 at offset 6000
    assert _max_rel(rope_shift(k0, offset + 1, rope_theta=theta), ko) > 0.2  # negative control (measured 0.36)
    back = rope_shift(ko, -offset, rope_theta=theta)
    assert _max_rel(back, k0) < 5e-4


@pytest.mark.parametrize("offset", [1, 37, 1000, 6000])
def test_reused_keys_equal_keys_at_offset_bf16(smollm2, offset):
    model, ids = smollm2
    theta = _rope_theta(model)
    k0 = _layer0_keys(model, ids, 0, torch.bfloat16)
    ko = _layer0_keys(model, ids, offset, torch.bfloat16)
    shifted = rope_shift(k0, offset, rope_theta=theta)
    assert shifted.dtype == torch.bfloat16
    # HF rounds cos/sin and the rotated key to bf16 (rel. 2^-8 each); the shift rounds once more
    err = _max_rel(shifted, ko)
    assert err < 1.5e-2, err  # measured 7.4e-3 (about two bf16 ulps)
    assert _max_rel(rope_shift(k0, offset + 1, rope_theta=theta), ko) > 0.2  # negative control (measured 0.36)
    # per-token deltas: place each token at its own offset
    per_tok = torch.full((ids.shape[1],), offset, dtype=torch.int64)
    assert torch.equal(rope_shift(k0, per_tok, rope_theta=theta), shifted)
