"""Contract on real attention: PSA decode over SmolLM2-135M's captured post-RoPE q/k/v (9/3 heads, d=64).

Each (layer, query position t) is one decode request over the real context ``[0, t]``; the
kernel must match the fp32 reference exactly in its stop decisions, for every estimator.
The issue's criterion "true kept mass >= epsilon for >= 99 % of (request, head) pairs":

  * ``paper`` (PSA Alg. 1, AS_min * N_left) does NOT meet it (strict xfail): AS_min * N_left
    underestimates the tail when block masses are flat and the cuboid ranking is imperfect.
    Measured (3 layers x 3 positions, 16-token blocks, eps 0.95, m 4): 70 % of pairs reach eps,
    39 % of blocks read.
  * ``bound`` (sum of block_size * 2^(scale * cuboid score) over unread blocks) meets it by
    construction but the cuboid bound at d=64 is loose: it reads every block here.
  * ``calibrated`` (the default: bound x 2^min(0, delta + 2), delta = tightest observed
    log2(block mass / bound)) meets it: 100 % of pairs, 83 % of blocks read. For scale: stopping
    with perfect knowledge of the true mass on the same cuboid ranking needs 55 %. (Over 8
    positions 400..1240 of the same layers, a torch simulation of the same rules: paper 69 %,
    calibrated 100 % at 82 % reads; a slack of 1 instead of 2 gives 97 %. On the GPU benchmark's
    8k SmolLM2 capture, 5 layers x 3 positions: calibrated 100 % at 59 % reads, paper 55 %.)
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from flashinfer_ext.psa.block_meta import BlockMetaPool, identity_block_table
from flashinfer_ext.psa.config import PsaDecodeConfig
from flashinfer_ext.psa.decode import PsaDecodeWrapper
from flashinfer_ext.common.reference import kept_mass_reference, progressive_decode_reference

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"
LAYERS = (3, 9, 15)
NUM_TOKENS = 1280
POSITIONS = (700, 1000, 1279)
BLOCK = 16


def _capture_module():
    spec = importlib.util.spec_from_file_location("psa_capture", ROOT / "bench" / "psa_capture.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def smollm_pool():
    if not (MODEL / "config.json").is_file():
        pytest.skip(f"SmolLM2 model folder missing at {MODEL}")
    pytest.importorskip("transformers")
    cap = _capture_module().capture_qkv(MODEL, num_tokens=NUM_TOKENS, layers=LAYERS)
    L = NUM_TOKENS
    k = torch.cat([cap[i][1] for i in LAYERS]).bfloat16()  # slot = layer_idx * L + pos
    v = torch.cat([cap[i][2] for i in LAYERS]).bfloat16()
    reqs = [(li, t) for li in range(len(LAYERS)) for t in POSITIONS]
    q = torch.stack([cap[LAYERS[li]][0][t] for li, t in reqs]).bfloat16()
    req_to_token = torch.stack([li * L + torch.arange(L) for li in range(len(LAYERS))]).to(torch.int32)
    rpi = torch.tensor([li for li, _ in reqs], dtype=torch.int32)
    seq_lens = torch.tensor([t + 1 for _, t in reqs], dtype=torch.int32)
    return q, k, v, req_to_token, rpi, seq_lens


EPSILON = 0.95


@pytest.fixture(scope="module", params=["paper", "bound", "calibrated"])
def psa_run(request, smollm_pool):
    q, k, v, req_to_token, rpi, seq_lens = smollm_pool
    batch, hk, d = q.shape[0], k.shape[1], k.shape[2]
    nb = -(-NUM_TOKENS // BLOCK)
    # the requests of one layer share their KV slots, so every request gets its own meta rows
    table = identity_block_table(torch.arange(batch, dtype=torch.int32), nb)
    mp = BlockMetaPool(1, batch * nb, hk, d, BLOCK, dtype=torch.bfloat16)
    mp.update(0, k, req_to_token, rpi, table, torch.zeros(batch, dtype=torch.int32), seq_lens, nb)
    cfg = PsaDecodeConfig(epsilon=EPSILON, micro_batch_blocks=4, sink_blocks=1, local_blocks=2,
                          estimator=request.param)
    w = PsaDecodeWrapper(cfg, num_qo_heads=q.shape[1], num_kv_heads=hk, head_dim=d, block_size=BLOCK,
                         max_batch_size=batch, max_blocks_per_req=nb, device="cpu", wave_programs=9 * 3 * 4)
    w.plan(req_to_token, rpi, seq_lens, table)
    o, lse, nread = w.run(q, k, v, *mp.layer(0))
    kept = kept_mass_reference(q, k, req_to_token, rpi, seq_lens, w.order, nread, block_size=BLOCK,
                               sm_scale=d ** -0.5)
    n_blocks = ((seq_lens + BLOCK - 1) // BLOCK).to(torch.int32)
    print(f"\n[smollm2] estimator={request.param} eps={EPSILON}: kept>=eps for {(kept >= EPSILON).float().mean():.3f} "
          f"of {kept.numel()} pairs, min kept {kept.min():.4f}, mean kept {kept.mean():.4f}, mean fraction of "
          f"blocks read {(nread.float() / n_blocks[:, None]).mean():.3f}")
    return dict(cfg=cfg, o=o.clone(), lse=lse.clone(), nread=nread.clone(), order=w.order.clone(),
                sorted=w.sorted_scores.clone(), kept_est=w.kept_est.clone(), kept=kept, n_blocks=n_blocks)


def test_kernel_matches_reference_on_captured_smollm2_attention(smollm_pool, psa_run):
    q, k, v, req_to_token, rpi, seq_lens = smollm_pool
    hk, d = k.shape[1], k.shape[2]
    cfg = psa_run["cfg"]
    nb = psa_run["n_blocks"]
    nf = torch.clamp(nb, max=3)
    lens = torch.minimum(nb, nf + cfg.max_blocks)[:, None].expand(-1, hk).contiguous()
    ro, rlse, rnread, rkept = progressive_decode_reference(
        q, k, v, req_to_token, rpi, seq_lens, psa_run["order"], lens, nf, block_size=BLOCK, sm_scale=d ** -0.5,
        epsilon=EPSILON, micro_batch_blocks=cfg.micro_batch_blocks, chunk_ends=cfg.ranked_chunk_ends(int(nb.max())),
        estimator=cfg.estimator, sorted_scores=psa_run["sorted"], calib_slack=cfg.calib_slack, return_kept_est=True)
    assert torch.equal(psa_run["nread"], rnread)
    if cfg.estimator != "bound":
        assert bool((psa_run["nread"] < lens).any()), "the stop test never fired on real attention"
    torch.testing.assert_close(psa_run["o"].float(), ro, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(psa_run["lse"], rlse, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(psa_run["kept_est"], rkept, rtol=1e-4, atol=1e-4)


def test_true_kept_mass_reaches_epsilon_for_99_percent_of_pairs(request, psa_run):
    if psa_run["cfg"].estimator == "paper":
        request.applymarker(pytest.mark.xfail(
            strict=True, reason="PSA Alg. 1's AS_min * N_left tail estimate is not conservative on SmolLM2 "
            "attention (see module docstring); the 'calibrated' default and 'bound' meet the criterion"))
    frac_ok = (psa_run["kept"] >= EPSILON).float().mean().item()
    assert frac_ok >= 0.99, f"kept >= eps for only {frac_ok:.3f} of pairs"


def test_kept_mass_is_high_on_average(request, psa_run):
    """Measured contract: mean kept mass >= eps - 0.05 (bound and the calibrated default). The paper's tail estimate
    keeps a mean 0.83 here since blocks are ranked by q . mean key: it stops on the first low-mass chunk."""
    if psa_run["cfg"].estimator == "paper":
        request.applymarker(pytest.mark.xfail(strict=True, reason="AS_min * N_left is not conservative"))
    assert psa_run["kept"].mean().item() >= EPSILON - 0.05


def test_reads_are_saved(request, psa_run):
    """Wanted: the stop test saves reads (< 90 % of the blocks) at 1.5k tokens. Ranked by q . mean key (the default,
    which reads the needle blocks the cuboid order dropped), the calibrated stop test still bounds the unread
    blocks by their cuboid upper bounds, which are loose after RoPE: it reads ~96 % of the blocks. A tighter bound
    on unread blocks is open work; this strict xfail turns into a failure once it lands (then drop the marker)."""
    read_frac = (psa_run["nread"].float() / psa_run["n_blocks"][:, None]).mean().item()
    if psa_run["cfg"].estimator == "bound":
        pytest.skip("the pure bound estimator reads until its bound is met; no read saving is claimed")
    if psa_run["cfg"].estimator == "calibrated":
        request.applymarker(pytest.mark.xfail(strict=True, reason="cuboid bound on unread blocks is loose"))
    assert read_frac < 0.9
