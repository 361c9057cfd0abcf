"""Contract: the side forward's masked attention (``sglang_sparse.samkv.side._attend``, fp32 path) equals a plain
softmax over the keys each row may see, with KV heads shared by their query-head group (GQA), for any mask."""

import pytest
import torch

from sglang_sparse.samkv.side import _attend


@pytest.mark.parametrize("hq,hkv", [(4, 1), (9, 3), (2, 2)])
def test_masked_gqa_attention_equals_the_softmax_reference(hq, hkv):
    g = torch.Generator().manual_seed(hq * 10 + hkv)
    r, c, d = 5, 11, 16
    q = torch.randn(r, hq, d, generator=g, dtype=torch.bfloat16)
    k = torch.randn(c, hkv, d, generator=g, dtype=torch.bfloat16)
    v = torch.randn(c, hkv, d, generator=g, dtype=torch.bfloat16)
    mask = torch.rand(r, c, generator=g) < 0.6
    mask[:, 0] = True  # every row sees at least one key
    scale = d ** -0.5
    got = _attend(q, k, v, mask, scale, model_dtype=False)
    kx = k.float().repeat_interleave(hq // hkv, dim=1)
    vx = v.float().repeat_interleave(hq // hkv, dim=1)
    logits = torch.einsum("rhd,chd->hrc", q.float(), kx) * scale
    logits = logits.masked_fill(~mask[None], float("-inf"))
    want = torch.einsum("hrc,chd->rhd", logits.softmax(-1), vx)
    torch.testing.assert_close(got.float(), want, rtol=1e-4, atol=1e-4)
