"""Capture post-RoPE decode attention inputs (q, k, v) of SmolLM2 on real text, on CPU.

Used by the PSA kernel tests and ``bench/psa_decode_bench.py`` (no sglang import).
The text is Python's own ``pydoc_data.topics`` (stdlib, always present). For each
captured layer it returns the keys/values of every position and the queries of every
position: treating query position ``t`` as a decode step over the context ``[0, t]``
gives real decode attention with varied context lengths.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "models" / "SmolLM2-135M-Instruct"


def real_text(num_chars: int = 60000) -> str:
    """Deterministic English/technical text from the stdlib (pydoc topics, sorted by key)."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return text[:num_chars]


CAPTURE_ATTN = "capture_causal_sdpa"


def _causal_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """HF attention function: K/V heads repeated to the query heads, then ``F.scaled_dot_product_attention``
    with ``is_causal`` (no mask tensor). ``query [B, Hq, L, d]``, ``key``/``value`` ``[B, Hk, S, d]``;
    returns ``([B, L, Hq, d], None)`` as HF's own functions do.

    HF's "sdpa" passes ``enable_gqa=True`` for grouped heads; on CUDA only the flash (fp16/bf16) and
    cuDNN backends accept that, so in fp32 it falls to the math backend, which materialises
    ``[Hq, L, L]`` fp32 scores (37 GiB per layer at 32k). With equal head counts fp32 runs on the
    memory-efficient backend (memory linear in L)."""
    rep = query.shape[1] // key.shape[1]
    if rep > 1:
        key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    causal = attention_mask is None and query.shape[2] > 1
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                           is_causal=causal, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def load_model(model_dir: str | os.PathLike = DEFAULT_MODEL, device: str = "cpu", attn: str = CAPTURE_ATTN):
    """``(tokenizer, model)``: the HF model in fp32, eval mode, with attention ``attn`` (default
    :func:`_causal_sdpa`, registered under ``CAPTURE_ATTN``: no ``[L, L]`` tensor on CPU or CUDA; an
    implementation HF has no mask function for gets no mask, so ``is_causal`` applies)."""
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="sdpa")
    if attn != "sdpa":
        AttentionInterface.register(CAPTURE_ATTN, _causal_sdpa)
        model.set_attn_implementation(attn)
    return tok, model.eval().to(device)


@torch.no_grad()
def capture_qkv(model_dir: str | os.PathLike = DEFAULT_MODEL, num_tokens: int = 1536,
                layers: tuple[int, ...] = (2, 10, 20, 28), text_offset: int = 0, device: str = "cpu",
                ids: torch.Tensor | None = None, model=None):
    """Run the model once; return ``{layer: (q [L, num_qo_heads, d], k [L, num_kv_heads, d], v [...])}`` fp32.

    ``q``/``k`` are after RoPE (with a YaRN config: its scaled rotary tables and attention factor, as
    the model applies them), exactly what SGLang writes to ``k_buffer`` / passes to decode.
    ``ids`` (``[L]`` int64) replaces the default text (``real_text()[text_offset:]`` cut to
    ``num_tokens``); ``model`` a ``load_model(...)[1]`` already loaded. The forward stops after the
    last captured layer. Attention is :func:`_causal_sdpa` (``load_model``'s default); on CUDA the math
    backend is excluded too, so a capture that would materialise ``[heads, L, L]`` fails instead of
    running out of memory.
    """
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    if model is None:
        model = load_model(model_dir, device)[1]
    if ids is None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(model_dir))
        ids = tok(real_text()[text_offset:], return_tensors="pt").input_ids[0, :num_tokens]
    ids = ids.reshape(1, -1).to(device)
    cfg = model.config
    hq, hk, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    out: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    hooks = []
    last = max(layers)

    class _Done(Exception):
        pass

    def make_hook(i, attn):
        def hook(_mod, args, kwargs):
            h = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            cos, sin = kwargs["position_embeddings"]
            L = h.shape[1]
            q = attn.q_proj(h).view(1, L, hq, d).transpose(1, 2)
            k = attn.k_proj(h).view(1, L, hk, d).transpose(1, 2)
            v = attn.v_proj(h).view(1, L, hk, d).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            out[i] = (q[0].transpose(0, 1).contiguous(), k[0].transpose(0, 1).contiguous(),
                      v[0].transpose(0, 1).contiguous())
            if i == last:
                raise _Done  # skip the remaining layers and the LM head
        return hook

    for i in layers:
        attn = model.model.layers[i].self_attn
        hooks.append(attn.register_forward_pre_hook(make_hook(i, attn), with_kwargs=True))
    try:
        if ids.is_cuda:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                              SDPBackend.CUDNN_ATTENTION]):
                model.model(ids)
        else:
            model.model(ids)
    except _Done:
        pass
    finally:
        for hk_ in hooks:
            hk_.remove()
    return out
