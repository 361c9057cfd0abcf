"""Captured attention of the 32k long-context testbed model on its own prompts, for the ``real_16k`` /
``real_32k`` headline entries of ``bench/psa_decode_bench.py`` and ``bench/loopserve_prefill_bench.py``.

What is captured (no planted structure in the attention):

* the prompt is a testbed task, exactly as the testbed sends it: :func:`bench.psa_real_capture.build_prompt`
  renders :func:`bench.tasks_long.make_needle_depth` (real prose from :mod:`bench.corpus`, one
  "secret number" sentence at 50 % depth, the question last) through the model's chat template with
  the bench's answer prefix. ``tokens=32000`` gives a ~32.3k-token prompt, ``16000`` ~16.3k. The
  303-paragraph corpus holds ~21k tokens, so a 32k haystack reuses paragraphs in a fresh shuffled
  order, as the testbed's own 32k prompts do;
* the model is the testbed folder (``models/SmolLM2-135M-Instruct-32k``: SmolLM2-135M weights, YaRN
  factor 4 in config.json), run by HF transformers in fp32 with SDPA (``is_causal``, no mask tensor:
  memory linear in the prompt; on CUDA the math backend is excluded) and stopped after the last
  captured layer (:func:`bench.psa_capture.capture_qkv`);
* per captured layer: post-RoPE ``q [L, 9, 64]``, ``k [L, 3, 64]``, ``v [L, 3, 64]`` fp32 (what SGLang
  stores in its KV pool and passes to attention); the benches cast them to bf16 as the server holds them.

Helpers here: the captures (:func:`testbed_captures`), the decode pool the PSA bench runs on
(:func:`decode_pool`), LoopServe's true covered mass on captured rows (:func:`covered_mass`) and the
merge of a ``--real-only`` run into an existing headline JSON (:func:`merge_real_rows`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
TESTBED_MODEL = ROOT / "models" / "SmolLM2-135M-Instruct-32k"
REAL_CASE = "testbed real"
NEEDLE_DEPTH = 0.5
MAX_POSITIONS = 32768  # the testbed model's max_position_embeddings


def parse_tokens(spec: str | None, default: dict[str, int]) -> dict[str, int]:
    """``"1024,2048"`` -> the slots of ``default`` in order with those prompt sizes (CPU smoke runs)."""
    if not spec:
        return dict(default)
    vals = [int(x) for x in spec.split(",") if x.strip()]
    if len(vals) != len(default):
        raise SystemExit(f"--real-tokens needs {len(default)} value(s) (for {', '.join(default)}), got {spec!r}")
    return dict(zip(default, vals))


def testbed_ids(tok, tokens: int, seed: int = 0) -> torch.Tensor:
    """``[L]`` int64 ids of the testbed needle prompt of ``tokens`` target tokens (L within a few % of it;
    shrunk until it fits the model's 32768 positions)."""
    from bench.psa_real_capture import build_prompt

    while True:
        ids = build_prompt(tok, tokens, NEEDLE_DEPTH, seed)[0]
        if ids.numel() <= MAX_POSITIONS:
            return ids
        tokens = int(tokens * MAX_POSITIONS / ids.numel()) - 64


def testbed_captures(model_dir, slot_tokens: dict[str, int], layers: tuple[int, ...], device: str, seed: int = 0):
    """Yield ``(slot, cap, info)`` per slot: one forward of the testbed prompt of ``slot_tokens[slot]``
    tokens; ``cap = {layer: (q [L, Hq, d], k [L, Hk, d], v [L, Hk, d])}`` fp32 on ``device``;
    ``info`` = prompt length, model path, layers, capture seconds, the rope type applied (checked against
    config.json: a YaRN folder read as plain RoPE raises) and its attention scaling. The model is loaded once."""
    import time

    from bench.psa_capture import capture_qkv, load_model

    tok, model = load_model(model_dir, device)
    want = (json.loads((Path(model_dir) / "config.json").read_text()).get("rope_parameters") or {}).get("rope_type")
    rope = getattr(model.model.rotary_emb, "rope_type", None)
    if want and rope != want:  # e.g. a transformers that does not read ``rope_parameters``: plain RoPE, silently
        raise RuntimeError(f"{model_dir}: config.json asks rope_type {want!r}, the loaded model applies {rope!r}")
    scaling = float(getattr(model.model.rotary_emb, "attention_scaling", 1.0))
    try:
        for slot, tokens in slot_tokens.items():
            ids = testbed_ids(tok, tokens, seed)
            t0 = time.time()
            cap = capture_qkv(model_dir, ids=ids, layers=tuple(layers), device=device, model=model)
            info = dict(prompt_tokens_target=tokens, prompt_len=int(ids.numel()), model=str(model_dir),
                        layers=list(layers), capture_s=round(time.time() - t0, 2), rope_type=rope,
                        rope_attention_scaling=round(scaling, 6),
                        prompt="bench.tasks_long needle_depth (middle), chat template, question last")
            yield slot, cap, info
            del cap
            if device == "cuda":
                torch.cuda.empty_cache()
    finally:
        del model


def decode_positions(L: int) -> list[int]:
    """Query positions used as decode steps of a prompt of ``L`` tokens: the last one (the step that emits
    the answer) and two inside the haystack, 1/16 and 1/8 of the prompt before the end."""
    return sorted({L - 1, L - 1 - L // 16, L - 1 - L // 8})


POOL_ALIGN = 64  # K/V pool slots per layer are padded to this (the dense paged decode views the pool as pages)


def decode_pool(cap: dict, layers, positions, dev):
    """The PSA bench's capture tuple ``(q, k, v, req_to_token, req_pool_indices, seq_lens)``: one decode
    request per (layer, position) with context ``[0, position]``; ``q [R, Hq, d]``, K/V pool
    ``[len(layers) * S, Hk, d]`` bf16 with ``S = L`` rounded up to ``POOL_ALIGN`` (layer ``li`` at slots
    ``li * S ..``, zeros after ``L``, so the pool is whole pages), one req_to_token row per request."""
    L = max(positions) + 1
    stride = -(-L // POOL_ALIGN) * POOL_ALIGN  # each layer's slots start on a page for every page size <= 64

    def padded(t):  # [L, Hk, d] -> [stride, Hk, d], zeros after L (slots no request reads)
        return torch.cat([t[:L], t.new_zeros((stride - L, *t.shape[1:]))])

    k = torch.cat([padded(cap[i][1]) for i in layers]).bfloat16().to(dev)
    v = torch.cat([padded(cap[i][2]) for i in layers]).bfloat16().to(dev)
    reqs = [(li, t) for li in range(len(layers)) for t in positions]
    q = torch.stack([cap[layers[li]][0][t] for li, t in reqs]).bfloat16().to(dev)
    rtt = torch.stack([li * stride + torch.arange(L) for li in range(len(layers))]).to(torch.int32).to(dev)
    rpi = torch.tensor([li for li, _ in reqs], dtype=torch.int32, device=dev)
    rows = rtt[rpi.long()].contiguous()
    return q, k, v, rows, torch.arange(len(reqs), dtype=torch.int32, device=dev), [t + 1 for _, t in reqs]


@torch.no_grad()
def covered_mass(q, k, sel, rows, sm_scale: float, chunk: int = 32) -> torch.Tensor:
    """True fraction of causal attention mass on the selected lines, per KV head ``[Hk]`` fp32.

    ``q [T, Hq, d]``, ``k [T, Hk, d]`` (contiguous positions ``0..T-1``, any float dtype, computed in fp32),
    ``sel`` a :class:`flashinfer_ext.loopserve.vs_select.VSSelection` (vertical key positions ``v_idx`` /
    slash offsets ``s_idx`` + counts), ``rows`` the query positions evaluated. Entry ``(t, j)`` is covered
    when ``j <= t`` and ``j`` is a selected vertical or ``t - j`` a selected slash offset (what
    ``vs_prefill`` attends to). Mass is summed over the group's query heads and the rows, then divided by
    the total (as :func:`flashinfer_ext.loopserve.reference.covered_mass_reference`), in row chunks.
    """
    T, hq, d = q.shape
    hk = k.shape[1]
    dev = q.device

    def mask_of(idx, cnt):
        w = idx.shape[1]
        ok = torch.arange(w, device=dev)[None, :] < cnt.to(dev).long()[:, None]
        pos = torch.where(ok, idx.to(dev).long().clamp(min=0), torch.full_like(idx.to(dev).long(), T))
        return torch.zeros(hk, T + 1, dtype=torch.bool, device=dev).scatter(1, pos, True)[:, :T]

    vmask, smask = mask_of(sel.v_idx, sel.v_cnt), mask_of(sel.s_idx, sel.s_cnt)
    kk = k.float().repeat_interleave(hq // hk, dim=1)  # [T, Hq, d]
    kpos = torch.arange(T, device=dev)
    cov = torch.zeros(hk, dtype=torch.float64, device=dev)
    tot = torch.zeros(hk, dtype=torch.float64, device=dev)
    rows = rows.to(dev).long()
    for c in range(0, rows.numel(), chunk):
        r = rows[c:c + chunk]
        s = torch.einsum("rhd,nhd->hrn", q[r].float(), kk) * sm_scale  # [Hq, R, T]
        off = r[:, None] - kpos[None, :]  # [R, T]
        s = s.masked_fill((off < 0)[None], float("-inf"))
        pg = torch.softmax(s, -1).view(hk, hq // hk, r.numel(), T).sum(1)  # [Hk, R, T]
        on_s = torch.gather(smask[:, None, :].expand(hk, r.numel(), T), 2, off.clamp(min=0)[None].expand(hk, -1, -1))
        m = (off >= 0)[None] & (vmask[:, None, :] | on_s)
        cov += (pg * m).sum((1, 2)).double()
        tot += pg.sum((1, 2)).double()
    return (cov / tot).float()


def finite(x):
    """JSON-safe float: None for missing / NaN / inf."""
    return None if x is None or not isinstance(x, (int, float)) or not math.isfinite(x) else float(x)


def merge_real_rows(path: Path, real_rows: list, real_keys: dict, run_meta: dict):
    """Merge a ``--real-only`` run into the headline JSON at ``path`` if it exists.

    Returns ``(top, meta, results)`` to write: the existing top-level keys with ``real_keys`` replaced or
    added, the existing meta with ``real_run`` = this run's meta, and the existing rows minus earlier
    rows of the (slot, estimator) pairs rerun here (``case == REAL_CASE``) plus ``real_rows``.
    Without an existing file: ``(None, run_meta, real_rows)`` (the caller computes its summary)."""
    if not path.is_file():
        return None, run_meta, list(real_rows)
    old = json.loads(path.read_text())
    results = old.pop("results", [])
    meta = old.pop("meta", {})
    rerun = {(r.get("slot"), r.get("estimator")) for r in real_rows}
    results = [r for r in results
               if not (r.get("case") == REAL_CASE and (r.get("slot"), r.get("estimator")) in rerun)] + list(real_rows)
    meta["real_run"] = run_meta
    old.update(real_keys)
    return old, meta, results


def finish_real_only(json_path, rows: list, summary: dict, meta: dict, write_report, t0: float) -> None:
    """``--real-only`` end of a kernel bench: merge ``rows`` and ``summary`` into the headline at ``json_path``
    (:func:`merge_real_rows`), rewrite its report with ``write_report(out_dir, meta, rows, top)``, print the summary."""
    import time

    meta["wall_s"] = time.time() - t0
    top, merged_meta, merged = merge_real_rows(json_path, rows, summary, meta)
    write_report(json_path.parent, merged_meta, merged, top)
    print(json.dumps(summary))
    print(f"wrote {json_path} (testbed real rows{' merged' if top else ''}) in {meta['wall_s']:.0f}s")
