"""Contract: under a YaRN-scaled model (the 32k testbed profile) a cached key re-rotated by ``delta`` with
the RoPE module's own ``inv_freq`` equals the key SGLang's YaRN RoPE computes at the shifted position, and
RoPE classes that cannot be re-rotated exactly are refused by name."""

from __future__ import annotations

import pytest
import torch

from flashinfer_ext.samkv.rope_shift import rope_shift_reference


def _rotate(rope, pos: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """NeoX rotation of ``k`` [n, heads, 64] at ``pos`` from the module's own cos/sin cache (what SGLang applies,
    YaRN's mscale included)."""
    cos, sin = rope.cos_sin_cache[pos].float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    x1, x2 = k[..., :32], k[..., 32:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _yarn_rope(factor: float, monkeypatch):
    """SGLang's own YaRN module as the 32k testbed builds it (head_dim 64, theta 1e5, original 8192). Outside a
    server no runtime context is published; the constructor only asks it whether to compile its fallback."""
    from types import SimpleNamespace

    import sglang.srt.layers.rotary_embedding.base as rope_base
    from sglang.srt.layers.rotary_embedding.yarn import YaRNScalingRotaryEmbedding

    monkeypatch.setattr(rope_base, "get_exec",
                        lambda: SimpleNamespace(deterministic=SimpleNamespace(rl_on_policy_target=None)))
    return YaRNScalingRotaryEmbedding(64, 64, 8192, 100000, True, factor, torch.float32)


@pytest.mark.parametrize("factor", [4.0, 8.0])
@pytest.mark.parametrize("delta", [1, 777, 20000])
def test_yarn_keys_shift_to_the_keys_at_the_new_position(factor, delta, monkeypatch):
    from sglang_sparse.samkv.assembly import rope_inv_freq_of

    rope = _yarn_rope(factor, monkeypatch)
    g = torch.Generator().manual_seed(0)
    n, heads = 12, 3
    k = torch.randn(n, heads, 64, generator=g)
    pos = torch.arange(100, 100 + n)
    k_at = _rotate(rope, pos, k)
    k_want = _rotate(rope, pos + delta, k)
    assert rope.mscale > 1.0  # YaRN scales cos/sin: the shift must keep that factor, not apply it twice
    inv = rope_inv_freq_of(rope)
    assert inv is not None and inv.shape == (32,)
    got = rope_shift_reference(k_at, torch.full((n,), delta), rope_theta=100000.0,
                               rotary_dim=64, inv_freq=inv)
    torch.testing.assert_close(got, k_want, atol=2e-3, rtol=1e-3)
    if delta < 777:
        return
    # plain-RoPE frequencies (the mistake this guards against) give other keys at long shifts
    wrong = rope_shift_reference(k_at, torch.full((n,), delta), rope_theta=100000.0, rotary_dim=64)
    assert (wrong - k_want).abs().max() > 1e-2


def test_unsupported_rope_is_refused_by_name():
    from sglang_sparse.samkv.assembly import rope_inv_freq_of

    class LinearScalingRotaryEmbedding(torch.nn.Module):
        is_neox_style = True

    with pytest.raises(RuntimeError, match="LinearScalingRotaryEmbedding"):
        rope_inv_freq_of(LinearScalingRotaryEmbedding())
