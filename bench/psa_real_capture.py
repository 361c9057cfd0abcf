"""PSA on real long-context attention: capture the 32k testbed's decode attention on CPU and
compare PSA's block selection with dense, per layer and KV head.

Usage::

    OMP_NUM_THREADS=1 python -m bench.psa_real_capture --tokens 4500 --out /tmp/psa_capture

Steps (one prompt per ``--depth``):
  1. Prompt: real prose (:func:`bench.corpus.haystack`) with one fact "Alice's secret number is
     4817." planted at the given depth, the question last, the trailer, the chat template with the
     bench's system prompt and the assistant turn opened with "The answer is" (as bench.tasks).
  2. HF transformers, CPU, fp32, the testbed's YaRN config: dense prefill, greedy first token
     (prefill stays dense under ``--sparse psa``), then the first decode step with a probe attention
     that records every layer's post-RoPE query and the whole post-RoPE K/V (what SGLang stores).
     Saved as ``DIR/cap_<tokens>_d<depth>.pt`` (reused when present).
  3. Per layer / KV head on that decode step, with :mod:`flashinfer_ext.common.reference`: the blocks PSA
     reads at the given config, their true softmax mass vs PSA's estimate, the rank of the
     number's block(s) under PSA's criticality and whether they are read, the number's true mass.
  4. End to end: greedy decode of the answer with every layer's decode attention replaced by the
     PSA reference (prefill dense), against dense greedy.
Writes ``DIR/summary_<tokens><tag>.json`` and prints a table (``--epsilons``: every variant also at those epsilons).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
from pathlib import Path

import torch

from bench import corpus

MODEL = Path(__file__).resolve().parent.parent / "models" / "SmolLM2-135M-Instruct-32k"
SYSTEM_PROMPT = ("You answer questions about texts the user sends. The question can appear anywhere "
                 "in a message and can be about an earlier message. Reply with the number only.")
TRAILER = "Answer the question above with the number only."
ANSWER_PREFIX = "The answer is"


def build_prompt(tok, n_tokens: int, depth: float, seed: int = 0):
    """``(ids [L], fact_positions, number_positions, number)``: the testbed's ``needle_depth`` task
    (:func:`bench.tasks_long.make_needle_depth`: real prose, one fact at 10/50/90 % depth, question
    last) rendered as SGLang's chat endpoint does with ``continue_final_message``."""
    from bench.tasks_long import DEPTHS, make_needle_depth

    position = min(DEPTHS, key=lambda p: abs(DEPTHS[p] - depth))
    task = make_needle_depth(position, n_tokens, seed)
    turn = task.turns[0]
    number = turn.answers[0]
    fact = next(p for p in turn.user.split("\n\n") if p.endswith(f"secret number is {number}."))
    msgs = [{"role": "system", "content": task.system}, {"role": "user", "content": turn.user}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) + task.answer_prefix
    enc = tok(text, return_offsets_mapping=True, add_special_tokens=False)
    c0 = text.index(fact)
    n0 = c0 + fact.index(number)
    span = lambda a, b: [i for i, (s, e) in enumerate(enc["offset_mapping"]) if s < b and e > a]  # noqa: E731
    return torch.tensor(enc["input_ids"]), span(c0, c0 + len(fact)), span(n0, n0 + len(number)), number


def _load_model():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(MODEL))
    model = AutoModelForCausalLM.from_pretrained(str(MODEL), dtype=torch.float32, attn_implementation="sdpa")
    return tok, model.eval()


_PROBE: dict = {}
_PSA: dict = {}


def _register():
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def probe(module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
        out = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kw)
        if query.shape[2] == 1:
            _PROBE[module.layer_idx] = (query[0, :, 0].float().clone(), key[0].transpose(0, 1).clone(),
                                        value[0].transpose(0, 1).clone(), out[0][0, 0].float().clone(), scaling)
        return out

    def psa(module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
        from flashinfer_ext.common.reference import psa_decode_reference

        cfg = _PSA.get("cfg")
        if query.shape[2] != 1 or cfg is None:
            return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kw)
        L = key.shape[2]
        eps = _PSA.get("eps_of_layer", lambda i: None)(module.layer_idx)
        o, _, nread, _ = psa_decode_reference(
            query[:, :, 0].float(), key[0].transpose(0, 1).float(), value[0].transpose(0, 1).float(),
            torch.arange(L)[None], torch.tensor([0]), torch.tensor([L]), cfg, block_size=_PSA["block_size"],
            sm_scale=scaling, epsilon=None if eps is None else [eps])
        _PSA.setdefault("read", []).append(float(nread.float().mean()) / -(-L // _PSA["block_size"]))
        return o[:, None].to(query.dtype), None

    AttentionInterface.register("psa_probe", probe)
    AttentionInterface.register("psa_ref", psa)


@torch.no_grad()
def _greedy(model, cache, first, n_new, impl):
    model.set_attn_implementation(impl)
    toks, nxt = [int(first)], torch.tensor([[int(first)]])
    for _ in range(n_new):
        out = model(nxt, past_key_values=cache, use_cache=True)
        t = int(out.logits[0, -1].argmax())
        toks.append(t)
        nxt = torch.tensor([[t]])
    return toks


@torch.no_grad()
def capture(tokens: int, depth: float, out_dir: Path, seed: int = 0, n_new: int = 16) -> dict:
    """Capture (or load) the decode step that emits the answer's first digit (dense greedy).

    Prefill stays dense under ``--sparse psa``; the digits come from decode steps. The dense reply is
    generated first; the step whose output is the first digit of the reply is replayed with the probe
    (its query and the whole post-RoPE K/V, the input token's included)."""
    path = out_dir / f"cap_{tokens}_d{int(depth * 100)}_s{seed}.pt"
    if path.exists():
        return torch.load(path)
    _register()
    tok, model = _load_model()
    ids, fact_pos, num_pos, number = build_prompt(tok, tokens, depth, seed)
    model.set_attn_implementation("sdpa")
    out = model(ids[None], use_cache=True, logits_to_keep=1)
    cache = out.past_key_values
    t1 = int(out.logits[0, -1].argmax())
    L = ids.numel()
    dense = _greedy(model, cache, t1, n_new, "sdpa")
    digit = [i for i, t in enumerate(dense) if tok.decode([t]).strip()[:1].isdigit()]
    j = digit[0] if digit and digit[0] >= 1 else 1      # the step that emits dense[j] has input dense[j - 1]
    cache.crop(L + j - 1)
    model.set_attn_implementation("psa_probe")
    _PROBE.clear()
    model(torch.tensor([[dense[j - 1]]]), past_key_values=cache, use_cache=True)
    layers = sorted(_PROBE)
    cap = dict(
        q=torch.stack([_PROBE[i][0] for i in layers]),                       # [layers, Hq, d] fp32
        k=torch.stack([_PROBE[i][1] for i in layers]).to(torch.bfloat16),    # [layers, L+j, Hkv, d]
        v=torch.stack([_PROBE[i][2] for i in layers]).to(torch.bfloat16),
        o_hf=torch.stack([_PROBE[i][3] for i in layers]),                    # HF's attention output
        scaling=float(_PROBE[0][4]), fact_pos=fact_pos, num_pos=num_pos, number=number, seed=seed,
        prompt_len=L, step=j, depth=depth, dense_tokens=dense, dense_text=tok.decode(dense),
        correct=number in tok.decode(dense), ids=ids)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.save(cap, path)
    return cap


@torch.no_grad()
def psa_generate(tokens: int, depth: float, cfg, block_size: int, n_new: int = 16, seed: int = 0,
                 eps_of_layer=None, _cache={}) -> tuple[str, float]:
    """Greedy answer with PSA reference decode at every layer (prefill dense). ``(text, mean read fraction)``."""
    _register()
    if "m" not in _cache:
        _cache["m"] = _load_model()
    tok, model = _cache["m"]
    key = (tokens, depth, seed)
    if key not in _cache:
        ids, _, _, _ = build_prompt(tok, tokens, depth, seed)
        model.set_attn_implementation("sdpa")
        out = model(ids[None], use_cache=True, logits_to_keep=1)
        _cache[key] = (out.past_key_values, int(out.logits[0, -1].argmax()), ids.numel())
    cache, t1, L = _cache[key]
    cache.crop(L)
    _PSA.update(cfg=cfg, block_size=block_size, read=[])
    if eps_of_layer is not None:
        _PSA["eps_of_layer"] = eps_of_layer
    else:
        _PSA.pop("eps_of_layer", None)
    toks = _greedy(model, cache, t1, n_new, "psa_ref")
    read = sum(_PSA["read"]) / max(1, len(_PSA["read"]))
    _PSA["cfg"] = None
    return tok.decode(toks), read


def analyse(cap: dict, cfg, block_size: int) -> dict:
    """Per (layer, KV head) PSA vs dense on the captured decode step."""
    from flashinfer_ext.common.reference import (block_meta_reference, criticality_reference, dense_decode_reference,
                                          kept_mass_reference, psa_decode_reference)

    q_all, k_all, v_all = cap["q"], cap["k"].float(), cap["v"].float()
    n_layers, hq, d = q_all.shape
    L, hkv = k_all.shape[1], k_all.shape[2]
    g = hq // hkv
    sm = cap["scaling"]
    rtt, rpi, lens = torch.arange(L)[None], torch.tensor([0]), torch.tensor([L])
    n_blocks = -(-L // block_size)
    num_blocks = sorted({p // block_size for p in cap["num_pos"]})
    rows = []
    for li in range(n_layers):
        q, k, v = q_all[li][None], k_all[li], v_all[li]
        o_d, _ = dense_decode_reference(q, k, v, rtt, rpi, lens, sm)
        scale_err = float((o_d[0] - cap["o_hf"][li]).abs().max())
        o, _, nread, order, kest = psa_decode_reference(q, k, v, rtt, rpi, lens, cfg, block_size=block_size,
                                                        sm_scale=sm, return_kept_est=True)
        kept = kept_mass_reference(q, k, rtt, rpi, lens, order, nread, block_size=block_size, sm_scale=sm)
        mn, mx, me = block_meta_reference(k, rtt, rpi, lens, block_size)[0]
        table = torch.arange(n_blocks)[None]
        sc = {(cr, gr): criticality_reference(q, mn, mx, me, table, lens, block_size=block_size,
                                              num_blocks=n_blocks, sink_blocks=cfg.sink_blocks,
                                              local_blocks=cfg.local_blocks, criticality=cr, group_reduce=gr)[0]
              for cr in ("cuboid", "mean") for gr in ("max", "sum")}
        logits = (q[0].view(hkv, g, d) @ k.permute(1, 2, 0)) * sm                        # [hkv, g, L]
        p = torch.softmax(logits, -1)
        blk_logit_max = torch.nn.functional.pad(logits, (0, n_blocks * block_size - L), value=-1e30) \
            .view(hkv, g, n_blocks, block_size).amax(-1)                                # [hkv, g, nb]
        for h in range(hkv):
            ordl = order[0, h].tolist()
            nr = int(nread[0, h])
            ranks = [ordl.index(b) for b in num_blocks]
            # rank among non-forced blocks under group max / group sum
            def rank_of(s, b):
                s = s[h].clone()
                return int((s[torch.isfinite(s)] > s[b]).sum()) if math.isfinite(float(s[b])) else -1
            nmass = p[h][:, cap["num_pos"]].sum(-1)                                      # [g]
            fmass = p[h][:, cap["fact_pos"]].sum(-1)
            best = blk_logit_max[h].amax(-1)                                              # [g]
            nb_best = blk_logit_max[h][:, num_blocks].amax(-1)
            rows.append(dict(
                layer=li, kv_head=h, read_frac=nr / n_blocks, kept_est=float(kest[0, h]),
                kept_true_min=float(kept[0, h * g:(h + 1) * g].min()),
                kept_true=[round(float(x), 4) for x in kept[0, h * g:(h + 1) * g]],
                needle_rank=min(ranks), needle_read=any(r < nr for r in ranks),
                needle_rank_max=min(rank_of(sc["cuboid", "max"], b) for b in num_blocks),
                needle_rank_sum=min(rank_of(sc["cuboid", "sum"], b) for b in num_blocks),
                needle_rank_mean=min(rank_of(sc["mean", "max"], b) for b in num_blocks),
                needle_rank_true=min(int((blk_logit_max[h].amax(0)[1:-2] > blk_logit_max[h].amax(0)[b]).sum())
                                     for b in num_blocks),
                blocks95={name: _blocks_for(p[h], blk_mass_order, block_size, n_blocks)
                          for name, blk_mass_order in (("cuboid", _order(sc["cuboid", "max"][h])),
                                                       ("mean", _order(sc["mean", "max"][h])),
                                                       ("oracle", _oracle_order(p[h], block_size, n_blocks)))},
                number_mass=[round(float(x), 4) for x in nmass], fact_mass=[round(float(x), 4) for x in fmass],
                needle_logit_gap=[round(float(x), 3) for x in (best - nb_best)],
                out_err=float((o[0, h * g:(h + 1) * g] - o_d[0, h * g:(h + 1) * g]).norm(dim=-1).max()
                              / o_d[0, h * g:(h + 1) * g].norm(dim=-1).max()),
                scale_err=scale_err))
    return dict(prompt_len=L, n_blocks=n_blocks, needle_blocks=num_blocks, rows=rows)


def _order(s: torch.Tensor) -> list[int]:
    """Forced blocks (+inf) first, then by descending score."""
    return torch.sort(s, descending=True, stable=True).indices.tolist()


def block_sums(x: torch.Tensor, block_size: int, n_blocks: int) -> torch.Tensor:
    """Per-block sums of ``x`` [rows, L] (the last block zero-padded): [rows, n_blocks]."""
    L = x.shape[-1]
    return torch.nn.functional.pad(x, (0, n_blocks * block_size - L)).view(x.shape[0], n_blocks, block_size).sum(-1)


def _oracle_order(p: torch.Tensor, block_size: int, n_blocks: int) -> list[int]:
    """Blocks by their true mass, the group's largest share first (what a perfect ranking would read first)."""
    return torch.sort(block_sums(p, block_size, n_blocks).amax(0), descending=True, stable=True).indices.tolist()


def summarize(res: dict) -> dict:
    """Means over the (layer, KV head) pairs of one analysis: the fraction of blocks the config read, and the
    fraction each order needs for every query head of the group to keep 95 % of its true mass (the cuboid and mean
    orders read the forced sink / local blocks first; ``oracle``, by the true block masses, has no forced blocks)."""
    rows, nb = res["rows"], res["n_blocks"]
    out = {"read_frac": sum(r["read_frac"] for r in rows) / len(rows),
           "kept_true_min": min(r["kept_true_min"] for r in rows)}
    for name in rows[0]["blocks95"]:
        fr = sorted(r["blocks95"][name] / nb for r in rows)
        out[f"blocks95_{name}"] = {"mean": sum(fr) / len(fr), "median": fr[len(fr) // 2], "max": fr[-1]}
    return out


def _blocks_for(p: torch.Tensor, order: list[int], block_size: int, n_blocks: int, target: float = 0.95) -> int:
    """Blocks read in ``order`` until every query head of the group keeps ``target`` of its true mass."""
    cum = block_sums(p, block_size, n_blocks)[:, order].cumsum(-1).amin(0)
    return int((cum < target).sum()) + 1


def print_table(res: dict, title: str) -> None:
    print(f"\n== {title}: L={res['prompt_len']} blocks={res['n_blocks']} needle blocks={res['needle_blocks']}")
    print("layer h  read  est    true   n_rank(read) rank_max rank_sum rank_mean rank_true number_mass(max) "
          "out_err  blocks95(cuboid/mean/oracle)")
    for r in res["rows"]:
        print(f"{r['layer']:5d} {r['kv_head']}  {r['read_frac']:.2f}  {r['kept_est']:.3f}  {r['kept_true_min']:.3f}  "
              f"{r['needle_rank']:5d}({'Y' if r['needle_read'] else 'n'})  {r['needle_rank_max']:7d} "
              f"{r['needle_rank_sum']:7d} {r['needle_rank_mean']:7d} {r['needle_rank_true']:7d}   "
              f"{max(r['number_mass']):.4f}        {r['out_err']:.3f}  {r['blocks95']['cuboid']}/{r['blocks95']['mean']}")


def main() -> None:
    from flashinfer_ext.psa.config import PsaDecodeConfig
    from sglang_sparse.config import PsaConfig
    from sglang_sparse.psa.runner import kernel_config

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4500)
    ap.add_argument("--cases", default="1:0.9,1:0.5,2:0.1",
                    help="seed:depth pairs of bench.tasks_long needle_depth tasks (depth 0.1/0.5/0.9)")
    ap.add_argument("--out", default="/tmp/psa_capture")
    ap.add_argument("--no-e2e", action="store_true")
    ap.add_argument("--variants", default="cuboid_rank,default",
                    help="cuboid_rank = ranking by the cuboid bound (before the fix); default = the defaults; "
                         "paper, sum_paper, mean_paper, dense, mean_est (the 'mean' estimator), mean_est4 / mean_est0 (its "
                         "calib_slack 4 / 0), calib0 (the default's calib_slack 0)")
    ap.add_argument("--epsilons", default=None,
                    help="comma-separated epsilons: every variant is also analysed at each (named VARIANT@EPS)")
    ap.add_argument("--tag", default="", help="suffix of the summary file: DIR/summary_<tokens><tag>.json")
    a = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    base = kernel_config(PsaConfig())
    bs = PsaConfig().block_size
    variants = {"default": base,
                "paper": dataclasses.replace(base, estimator="paper"),
                "sum_paper": dataclasses.replace(base, estimator="paper", group_reduce="sum"),
                "dense": dataclasses.replace(base, epsilon=1.0),
                "mean_paper": dataclasses.replace(base, estimator="paper", criticality="mean"),
                "cuboid_rank": dataclasses.replace(base, rank_by="criticality"),
                "mean_est": dataclasses.replace(base, criticality="mean", estimator="mean"),
                "mean_est4": dataclasses.replace(base, criticality="mean", estimator="mean", calib_slack=4.0),
                "mean_est0": dataclasses.replace(base, criticality="mean", estimator="mean", calib_slack=0.0),
                "calib0": dataclasses.replace(base, calib_slack=0.0)}
    names = a.variants.split(",")
    if a.epsilons:
        for name in list(names):
            for e in (float(x) for x in a.epsilons.split(",")):
                variants[f"{name}@{e:g}"] = dataclasses.replace(variants[name], epsilon=e)
                names.append(f"{name}@{e:g}")
    summary = {"tokens": a.tokens, "config": dataclasses.asdict(base), "runs": []}
    for case in a.cases.split(","):
        seed, depth = int(case.split(":")[0]), float(case.split(":")[1])
        cap = capture(a.tokens, depth, out, seed)
        print(f"\n### seed {seed} depth {depth}: L={cap['prompt_len']} number {cap['number']} dense answer "
              f"{cap['dense_text']!r} (correct: {cap['correct']}; captured decode step {cap['step']})")
        run = {"seed": seed, "depth": depth, "prompt_len": cap["prompt_len"], "number": cap["number"],
               "dense": cap["dense_text"], "dense_correct": cap["correct"], "variants": {}}
        for name in names:
            cfg = variants[name]
            res = analyse(cap, cfg, bs)
            print_table(res, f"{name} depth {depth}")
            rec = {"analysis": res, "summary": summarize(res)}
            print(f"summary {name}: " + json.dumps(rec["summary"]))
            if not a.no_e2e:
                text, read = psa_generate(a.tokens, depth, cfg, bs, seed=seed)
                rec.update(e2e_text=text, e2e_read=read, e2e_correct=cap["number"] in text)
                print(f"e2e {name}: {text!r} correct {cap['number'] in text} read {read:.3f}")
            run["variants"][name] = rec
        summary["runs"].append(run)
    (out / f"summary_{a.tokens}{a.tag}.json").write_text(json.dumps(summary, indent=1, default=str))


if __name__ == "__main__":
    main()
