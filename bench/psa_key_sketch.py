"""PSA's stop test with a quantized-key sketch, simulated on captured real decode attention (CPU, fp32).

PSA ranks KV blocks and stops reading once the kept share of the softmax mass passes epsilon; what it cannot see is
the mass of the blocks it has not read, so its estimators bound or extrapolate it from per-block metadata (min, max,
mean key). On the 32k testbed model those estimates are so conservative that PSA reads 0.87-0.92 of the blocks
where 0.21-0.36 (in its own rank order) would keep 95 % of every head's mass (``bench.psa_read_floor``).

This script asks what a per-token *sketch* of the keys would do instead: every key quantized (``int4``: symmetric,
one scale per token and KV head; ``int8``; ``fp8``: e4m3), approximate logits q . k_sketch for every token, and

* rank: blocks by the group max of their approximate mass share;
* stop: after each block read, the exact mass of the blocks read (from the real keys) against the approximate mass
  of the unread ones times ``2^slack``; stop once every query head's kept share passes epsilon.

Sink and local blocks are read first, as PSA does. Per config and captured step it reports the fraction of blocks
read, the true kept mass (smallest over the (layer, KV head) pairs), the pairs whose attention output differs from
dense by more than 0.1 (the group's largest error norm over its largest dense output norm, as
``bench.psa_real_capture`` measures it), and the bytes read against dense: sketch bytes (every token's quantized key and
its scale) + the blocks read (K and V, bf16).

Usage (captures from ``bench.psa_real_capture``)::

    python -m bench.psa_key_sketch /tmp/psacap/cap_16000_d90_s1.pt ... --out /tmp/sketch.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

SKETCH_BITS = {"int4": 4, "int8": 8, "fp8": 8}


def sketch_keys(k: torch.Tensor, kind: str) -> torch.Tensor:
    """Dequantized sketch of ``k`` [L, H, d] (fp32 out): ``int4`` / ``int8`` symmetric with one fp16 scale per (token,
    head), ``fp8`` e4m3 with one scale per (token, head)."""
    k = k.float()
    amax = k.abs().amax(-1, keepdim=True).clamp_min(1e-6)
    if kind in ("int4", "int8"):
        qmax = 7.0 if kind == "int4" else 127.0
        scale = (amax / qmax).half().float()
        return torch.round(k / scale).clamp(-qmax, qmax) * scale
    if kind == "fp8":
        scale = (amax / 448.0).half().float()
        return (k / scale).to(torch.float8_e4m3fn).float() * scale
    raise ValueError(f"sketch kind must be one of {sorted(SKETCH_BITS)}, got {kind!r}")


def simulate_pair(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ks: torch.Tensor, sm: float, block: int,
                  eps: float, slack: float, sink: int = 1, local: int = 2) -> dict:
    """One KV head's group: ``q`` [g, d], ``k`` / ``v`` / ``ks`` [L, d]. Returns read blocks, true kept mass per query
    head, and the relative output error against dense."""
    from bench.psa_real_capture import block_sums

    L = k.shape[0]
    nb = -(-L // block)
    logits = (q @ k.T) * sm                                                   # [g, L]
    approx = (q @ ks.T) * sm
    m = torch.maximum(logits.amax(-1, keepdim=True), approx.amax(-1, keepdim=True))
    true_blk = block_sums((logits - m).exp(), block, nb)                      # [g, nb]
    appr_blk = block_sums((approx - m).exp(), block, nb)
    forced = sorted(set(range(min(sink, nb))) | set(range(max(0, nb - local), nb)))
    share = appr_blk / appr_blk.sum(-1, keepdim=True)
    rest = [b for b in torch.sort(share.amax(0), descending=True, stable=True).indices.tolist() if b not in forced]
    order = forced + rest
    idx = torch.tensor(order)
    kept_cum = true_blk[:, idx].cumsum(-1)                                     # [g, nb] in read order
    unread = (appr_blk.sum(-1, keepdim=True) - appr_blk[:, idx].cumsum(-1)).clamp_min(0)
    ok = (kept_cum / (kept_cum + 2.0 ** slack * unread) >= eps).all(0)         # [nb]: stop after block i
    ok[:max(0, len(forced) - 1)] = False                                        # the forced blocks are read first
    hits = torch.nonzero(ok)
    n = int(hits[0]) + 1 if hits.numel() else len(order)
    p = torch.softmax(logits, -1)
    blk_read = torch.zeros(nb, dtype=torch.bool)
    blk_read[idx[:n]] = True
    mask = blk_read.repeat_interleave(block)[:L]
    o_dense = p @ v
    ps = torch.where(mask, p, torch.zeros_like(p))
    o_sparse = (ps / ps.sum(-1, keepdim=True)) @ v
    err = float((o_sparse - o_dense).norm(dim=-1).max() / o_dense.norm(dim=-1).max().clamp_min(1e-9))
    kept = true_blk[:, blk_read].sum(-1) / true_blk.sum(-1)
    return {"read": n, "blocks": nb, "kept_min": float(kept.min()), "out_err": err, "o": o_sparse}


def run(cap: dict, kind: str, eps: float, slack: float, block: int = 16) -> dict:
    """Every (layer, KV head) pair of one capture (``bench.psa_real_capture``'s ``cap_*.pt``)."""
    q_all, k_all, v_all, sm = cap["q"].float(), cap["k"], cap["v"].float(), cap["scaling"]
    n_layers, hq, d = q_all.shape
    hkv = k_all.shape[2]
    g = hq // hkv
    rows = []
    for li in range(n_layers):
        ks_all = sketch_keys(k_all[li], kind)
        for h in range(hkv):
            r = simulate_pair(q_all[li, h * g:(h + 1) * g], k_all[li, :, h].float(), v_all[li, :, h],
                              ks_all[:, h], sm, block, eps, slack)
            r.pop("o")
            rows.append(dict(layer=li, kv_head=h, **r))
    nb = rows[0]["blocks"]
    read = sum(r["read"] for r in rows) / (len(rows) * nb)
    kv_bytes_per_token = 2 * d * 2                         # K + V, bf16, one KV head
    sketch_bytes_per_token = d * SKETCH_BITS[kind] / 8 + 2  # quantized key + fp16 scale
    return {"prompt_len": cap["prompt_len"], "depth": cap["depth"], "sketch": kind, "eps": eps, "slack": slack,
            "read_frac": read, "kept_true_min": min(r["kept_min"] for r in rows),
            "pairs_out_err_gt_0.1": sum(r["out_err"] > 0.1 for r in rows), "pairs": len(rows),
            "max_out_err": max(r["out_err"] for r in rows),
            "bytes_vs_dense": read + sketch_bytes_per_token / kv_bytes_per_token}


def _where(depth) -> str:
    """A needle's depth as a percentage, or a rag task's description as it is."""
    return f"{depth:.0%}" if isinstance(depth, (int, float)) else str(depth)


def markdown(rows: list[dict], e2e: list[dict], command: str, notes: list[str], env: str = "") -> str:
    """The report: one row per (capture, sketch, epsilon, slack), then the greedy answers."""
    out = ["# PSA with a quantized-key sketch as its stop test (simulation on captured real attention)", "",
           f"- command: `{command}`",
           f"- device and versions: {env}",
           "- CPU, fp32, the 32k testbed model (SmolLM2-135M-Instruct, YaRN x4), block 16, sink 1 and local 2 blocks "
           "read first; one decode step per capture (the step that emits the needle's first digit)",
           "- bytes vs dense: the blocks read (K and V, bf16) + every token's sketch (quantized key + fp16 scale), "
           "over dense K and V", ""]
    if rows:
        out += ["| prompt tokens | depth | sketch | epsilon | slack | blocks read | smallest true kept mass | "
                "pairs with output error > 0.1 | largest output error | bytes vs dense |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        out += [f"| {r['prompt_len']} | {r['depth']:.0%} | {r['sketch']} | {r['eps']:g} | {r['slack']:g} | "
                f"{r['read_frac']:.3f} | {r['kept_true_min']:.4f} | {r['pairs_out_err_gt_0.1']} / {r['pairs']} | "
                f"{r['max_out_err']:.3f} | {r['bytes_vs_dense']:.3f} |" for r in rows]
    if e2e:
        out += ["", "Greedy answers, every layer's decode attention through the sketch-driven selection (prefill "
                "dense), 16 tokens:", "",
                "| prompt tokens | needle depth / task | seed | sketch | epsilon | slack | blocks read | same as dense | "
                "dense right | "
                "sketched right |", "|---|---|---|---|---|---|---|---|---|---|"]
        out += [f"| {r['prompt_len']} | {_where(r['depth'])} | {r['seed']} | {r['sketch']} | {r['eps']:g} | "
                f"{r['slack']:g} | {r['read_frac']:.3f} | {'yes' if r['same'] else 'no'} | "
                f"{'yes' if r['dense_correct'] else 'no'} | {'yes' if r['sketched_correct'] else 'no'} |" for r in e2e]
    return "\n".join(out) + "\n" + "".join(f"\n{n}\n" for n in notes)


def rag_prompt(tok, position: str, docs: int, seed: int):
    """``(ids, None, None, number)`` of the testbed's ``rag`` task (:func:`bench.tasks_long.make_rag`: ``docs``
    documents, the needed fact in one, the question at ``position``), rendered as the chat endpoint does with the
    answer prefix continued (as :func:`bench.psa_real_capture.build_prompt`)."""
    from bench.tasks_long import make_rag

    task = make_rag(position, docs, seed)
    msgs = [{"role": "system", "content": task.system}, {"role": "user", "content": task.turns[0].user}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) + task.answer_prefix
    return torch.tensor(tok(text, add_special_tokens=False)["input_ids"]), None, None, task.turns[0].answers[0]


@torch.no_grad()
def sketch_generate(tokens: int, depth: float, seed: int, kind: str, eps: float, slack: float,
                    n_new: int = 16, block: int = 16, rag: tuple[str, int] | None = None) -> dict:
    """Greedy answer of the testbed model with every layer's decode attention replaced by the sketch-driven
    selection (prefill dense), against dense greedy: ``{"dense", "sketch", "same", "read_frac"}``. The prompt is
    the needle task of ``tokens`` at ``depth``, or with ``rag=(position, docs)`` the rag task."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from bench.psa_real_capture import _greedy, _load_model, build_prompt

    reads: list[float] = []

    def attn(module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
        if query.shape[2] != 1:
            return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kw)
        hq, hkv = query.shape[1], key.shape[1]
        g = hq // hkv
        q, k, v = query[0, :, 0].float(), key[0].float(), value[0].float()      # [Hq, d], [Hkv, L, d]
        ks = sketch_keys(k.transpose(0, 1), kind).transpose(0, 1)
        outs = []
        for h in range(hkv):
            r = simulate_pair(q[h * g:(h + 1) * g], k[h], v[h], ks[h], scaling, block, eps, slack)
            outs.append(r["o"])
            reads.append(r["read"] / r["blocks"])
        return torch.cat(outs)[None, None].to(query.dtype), None

    AttentionInterface.register("psa_sketch", attn)
    tok, model = _load_model()
    ids, _, _, number = build_prompt(tok, tokens, depth, seed) if rag is None else rag_prompt(tok, *rag, seed)
    model.set_attn_implementation("sdpa")
    out = model(ids[None], use_cache=True, logits_to_keep=1)
    cache, first, L = out.past_key_values, int(out.logits[0, -1].argmax()), ids.numel()
    dense = tok.decode(_greedy(model, cache, first, n_new, "sdpa"))
    cache.crop(L)
    sketch = tok.decode(_greedy(model, cache, first, n_new, "psa_sketch"))
    return {"prompt_len": L, "depth": depth if rag is None else f"rag {rag[0]}, {rag[1]} docs", "seed": seed,
            "number": number, "sketch": kind, "eps": eps,
            "slack": slack, "dense": dense, "sketched": sketch, "same": dense == sketch,
            "dense_correct": number in dense, "sketched_correct": number in sketch,
            "read_frac": sum(reads) / max(1, len(reads))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("captures", nargs="*", help="cap_*.pt files of bench.psa_real_capture")
    ap.add_argument("--sketches", default="int4,fp8", help=f"comma-separated: {', '.join(SKETCH_BITS)}")
    ap.add_argument("--epsilons", default="0.95")
    ap.add_argument("--slacks", default="0,1", help="log2 factors on the sketch's unread mass")
    ap.add_argument("--e2e", default=None, metavar="TOKENS:SEED:DEPTH,...",
                    help="also greedy-decode these testbed prompts with the sketch at every layer (first sketch, "
                         "epsilon and slack given) against dense")
    ap.add_argument("--e2e-rag", default=None, metavar="POSITION:DOCS:SEED,...",
                    help="as --e2e, on the testbed's rag task (question at begin / middle / end of DOCS documents)")
    ap.add_argument("--out", required=True, help="JSON of every row")
    ap.add_argument("--md", default=None, help="also write the report as Markdown here")
    ap.add_argument("--merge", nargs="*", default=[], metavar="JSON",
                    help="fold the rows of earlier --out files into this report (no new runs needed)")
    ap.add_argument("--command", default="", help="the command(s) that produced the figures, for the report")
    ap.add_argument("--note", action="append", default=[], help="a paragraph printed under the tables (repeat)")
    a = ap.parse_args(argv)
    rows, e2e = [], []
    if a.e2e:
        for case in a.e2e.split(","):
            try:
                t, seed, depth = (f(x) for f, x in zip((int, int, float), case.split(":"), strict=True))
            except ValueError:
                ap.error(f"--e2e: {case!r} is not TOKENS:SEED:DEPTH (e.g. 16000:1:0.9)")
            r = sketch_generate(t, depth, seed, a.sketches.split(",")[0],
                                float(a.epsilons.split(",")[0]), float(a.slacks.split(",")[0]))
            e2e.append(r)
            print(json.dumps(r), flush=True)
    if a.e2e_rag:
        for case in a.e2e_rag.split(","):
            parts = case.split(":")
            if len(parts) != 3 or parts[0] not in ("begin", "middle", "end") or not (parts[1] + parts[2]).isdigit():
                ap.error(f"--e2e-rag: {case!r} is not POSITION:DOCS:SEED (e.g. begin:8:1)")
            r = sketch_generate(0, 0.0, int(parts[2]), a.sketches.split(",")[0], float(a.epsilons.split(",")[0]),
                                float(a.slacks.split(",")[0]), rag=(parts[0], int(parts[1])))
            e2e.append(r)
            print(json.dumps(r), flush=True)
    for path in a.captures:
        cap = torch.load(path)
        for kind in a.sketches.split(","):
            for eps in (float(x) for x in a.epsilons.split(",")):
                for slack in (float(x) for x in a.slacks.split(",")):
                    r = run(cap, kind, eps, slack)
                    rows.append(r)
                    print(json.dumps(r), flush=True)
    for path in a.merge:
        prev = json.loads(Path(path).read_text())
        rows += prev.get("rows", [])
        e2e += prev.get("e2e", [])
    from bench.psa_read_floor import run_env

    env = run_env()
    Path(a.out).write_text(json.dumps({"command": a.command, "env": env, "rows": rows, "e2e": e2e}, indent=1))
    if a.md:
        Path(a.md).write_text(markdown(rows, e2e, a.command, a.note, env))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
