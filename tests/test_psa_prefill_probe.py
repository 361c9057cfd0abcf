"""Contract (CPU): the adaptive switch's prefill probe. The extend that writes a long prompt's last token runs PSA's
stop test for that token's query, per layer, and reports the blocks it would read in the request's prefill row
(kind 4); the request decodes with stock steps until that row decides it; earlier chunks, short prompts, epsilon 1.0
and the switch turned off are never probed; such an extend never replays a prefill CUDA graph."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from sglang_sparse.config import PsaConfig
from sglang_sparse.psa.runner import AttnShape, PsaCpuRunner
from sglang_sparse.psa.switch import _PREFILL_PROBE_ATTR, adaptive_dense
from sglang_sparse.psa.stats import (COL_EPS, PsaStats, COL_READ, COL_SPARSE, COL_TOTAL, COL_UNITS, ROW_ADAPTIVE_DENSE,
                                     ROW_PREFILL_PROBE, STEP_COLS, STEP_KEY)

LAYERS, HQ, HK, D, BLOCK = 2, 4, 2, 16, 16


def _req(prompt: int, out: int = 0, eps=None, rows=None):
    custom = {"sparse": {"epsilon": eps}} if eps is not None else None
    return SimpleNamespace(sampling_params=SimpleNamespace(custom_params=custom), origin_input_ids=[0] * prompt,
                           output_ids=[0] * out, customized_info={STEP_KEY: list(rows or [])}, rid=id(object()))


def _extend(lens, ext, reqs, device="cpu"):
    mode = SimpleNamespace(is_idle=lambda: False, is_decode=lambda: False)
    return SimpleNamespace(forward_mode=mode, batch_size=len(lens), seq_lens_cpu=torch.tensor(lens),
                           seq_lens=torch.tensor(lens, device=device), req_pool_indices=torch.arange(len(lens), device=device),
                           extend_seq_lens_cpu=list(ext), extend_prefix_lens_cpu=[n - e for n, e in zip(lens, ext)],
                           sampling_info=SimpleNamespace(sparse_reqs=list(reqs)))


def _cfg(**kw):
    return PsaConfig.from_dict({"min_context": 128, "block_size": BLOCK, "dense_above": 0.5, **kw})


def test_only_the_last_chunk_of_a_long_undecided_prompt_is_probed():
    runner = PsaCpuRunner(_cfg(), BLOCK, AttnShape(LAYERS, HQ, HK, D), torch.device("cpu"))
    last, chunk, short, dense, decided = _req(200), _req(300), _req(60), _req(200, eps=1.0), _req(200)
    decided._sparse_psa_probe = False
    fb = _extend([200, 150, 60, 200, 200], [30, 150, 60, 200, 200], [last, chunk, short, dense, decided])
    assert runner.extend_probe_rows(fb) == [0]  # chunk: 150 of its 300 prompt tokens; the others: short, eps 1, done
    retracted = _req(180, out=20)  # a retracted request re-prefills its prompt and outputs
    assert runner.extend_probe_rows(_extend([200], [200], [retracted])) == [0]
    off = PsaCpuRunner(_cfg(dense_above=1.0), BLOCK, AttnShape(LAYERS, HQ, HK, D), torch.device("cpu"))
    assert off.extend_probe_rows(fb) == []  # the switch turned off: no probe


def test_prefill_row_decides_and_steps_before_it_are_stock():
    cfg = _cfg()
    runner = PsaCpuRunner(cfg, BLOCK, AttnShape(LAYERS, HQ, HK, D), torch.device("cpu"))
    req = _req(200)
    setattr(req, _PREFILL_PROBE_ATTR, True)
    mode = SimpleNamespace(is_idle=lambda: False, is_decode=lambda: True)
    fb = SimpleNamespace(forward_mode=mode, batch_size=1, seq_lens_cpu=torch.tensor([201]),
                         sampling_info=SimpleNamespace(sparse_reqs=[req]))
    runner.begin_batch(None, fb)  # the decision is not back yet: a stock step, reported as plain dense
    assert not runner.sparse_batch and runner.dense_rows[0][0][COL_SPARSE] == 0
    row = [0.0] * STEP_COLS
    row[COL_SPARSE], row[COL_READ], row[COL_TOTAL], row[COL_UNITS], row[COL_EPS] = ROW_PREFILL_PROBE, 30, 52, 4, 0.95
    req.customized_info[STEP_KEY].append(row)
    runner.begin_batch(None, fb)  # 30 / 52 blocks > 0.5: dense for good
    assert adaptive_dense(cfg, req) and runner.dense_rows[0][0][COL_SPARSE] == ROW_ADAPTIVE_DENSE
    focused = _req(200, rows=[[ROW_PREFILL_PROBE, 10, 52, 0, 4, 0.95]])
    setattr(focused, _PREFILL_PROBE_ATTR, True)
    fb.sampling_info.sparse_reqs = [focused]
    runner.begin_batch(None, fb)  # 10 / 52: PSA from this step on
    assert not adaptive_dense(cfg, focused) and runner.sparse_batch


def test_an_extend_with_a_prefill_probe_keeps_sglangs_prefill_graph_answer():
    """The probe runs inside forward_extend, which SGLang's breakable prefill graphs call eagerly between their
    captured segments: psa never vetoes a prefill graph (SGLang's answer stands, with or without a probe)."""
    from sglang_sparse.api_hooks import prefill_graph_gate_hook
    from sglang_sparse.psa.backend import PsaDecodeMixin

    backend = type("PsaBackend", (), dict(vars(PsaDecodeMixin)))()
    backend._psa_runner = PsaCpuRunner(_cfg(), BLOCK, AttnShape(LAYERS, HQ, HK, D), torch.device("cpu"))
    backend.sparse_stats = PsaStats()
    graph_runner = SimpleNamespace(model_runner=SimpleNamespace(attn_backend=backend))
    probed = _extend([200], [30], [_req(200)])
    assert backend._psa_runner.extend_probe_rows(probed) == [0]
    assert prefill_graph_gate_hook(True, graph_runner, probed) is True
    assert backend.sparse_stats.prefill_probe_graph_extends == 1  # counted: SGLang replays it
    assert prefill_graph_gate_hook(False, graph_runner, probed) is False
    assert prefill_graph_gate_hook(True, graph_runner, _extend([60], [60], [_req(60)])) is True
    assert backend.sparse_stats.prefill_probe_graph_extends == 1  # no probe, or no replay: not counted