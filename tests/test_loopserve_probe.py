"""Contract: the LoopServe phase probe's causal score matrix masks exactly the future keys and shares each KV
head across its query-head group (what its coverage figures in loopserve_root_cause.md are computed from)."""

from __future__ import annotations

import torch


def test_causal_probs_masks_future_keys_per_query_group():
    from bench.loopserve_probe import causal_probs

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(6, 3, 8, generator=g), torch.randn(2, 5, 8, generator=g)   # 6 query heads, 2 KV heads
    qpos = torch.tensor([1, 2, 4])
    s = causal_probs(q, k, qpos, 0.5)
    assert s.shape == (6, 3, 5)
    for h in range(6):
        for t, p in enumerate(qpos.tolist()):
            want = (q[h, t] @ k[h // 3].T) * 0.5
            torch.testing.assert_close(s[h, t, : p + 1], want[: p + 1])
            assert torch.isinf(s[h, t, p + 1:]).all()


def test_the_probes_dense_phases_decode_as_the_model_and_its_state_travels_with_the_call(default_model):
    """Dense prefill + dense decode through the simulator's attention gives the model's own greedy tokens, and each
    run's Sim (passed as a forward kwarg, not module state) records every layer's prefill."""
    from transformers import AutoModelForCausalLM

    from bench.loopserve_probe import Probe

    probe = Probe(str(default_model))
    text = "Notes. " * 60 + "The secret number is 4821. " + "More notes. " * 40 + "What is the secret number?"
    ids = probe.chat_ids([{"role": "user", "content": text}], add_generation_prompt=True)
    got, sim = probe.generate(ids, dict(prefill="dense", decode="dense"), max_new=4)
    model = AutoModelForCausalLM.from_pretrained(str(default_model), dtype=torch.float32).eval()
    ref = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=4, do_sample=False)
    assert got == probe.tok.decode(ref[0, len(ids):].tolist())
    layers = model.config.num_hidden_layers
    assert sim.prompt_len == len(ids) and sorted(sim.log) == list(range(layers))
    _, other = probe.generate(ids, dict(prefill="sparse", decode="sparse"), max_new=2)
    assert other is not sim and len(other.lines) == layers
