"""HF-transformers simulator of the LoopServe CPU reference path, phase by phase (batch 1, fp32): sparse or dense prefill (lines from sample_query_rows + vs_select, vs_prefill_reference), sparse or dense decode (stored lines + initial top-B + Alg. 3), per-row coverage probes. Used for bench/results/loopserve_root_cause.md; usage: probe = Probe(); probe.generate(probe.prompt_ids(task), dict(prefill="sparse", decode="dense"), max_new=7).
The simulator state of a run travels with the forward call (``ls_sim``), not in module state."""
import dataclasses

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, AttentionInterface
from flashinfer_ext.loopserve.reference import vs_estimate_reference, vs_prefill_reference, decode_topb_reference
from flashinfer_ext.loopserve.vs_estimate import VSLineSums, sample_query_rows
from flashinfer_ext.loopserve.vs_select import VSSelectConfig, vs_select

MODEL = str(__import__("pathlib").Path(__file__).resolve().parents[1] / "models" / "SmolLM2-135M-Instruct-32k")

@dataclasses.dataclass
class Sim:
    prefill: str = "sparse"     # sparse | dense
    decode: str = "sparse"      # sparse | dense
    alpha: float = 0.99
    rows: int = 64
    budget: int = 1024
    n_d: int = 16
    sink: int = 4
    local: int = 64
    initial_topb: bool = True
    sampler: object = None      # f(T, rows) -> local indices
    dense_rows: object = None   # local row indices computed densely in a sparse prefill
    cov_rows: object = None
    capture: tuple = ()
    cap: dict = dataclasses.field(default_factory=dict)
    force_v: object = None      # positions forced as vertical lines
    # state
    prompt_len: int = 0
    lines: dict = dataclasses.field(default_factory=dict)   # layer -> (vset [Hk] list of tensors, sset)
    ring: dict = dataclasses.field(default_factory=dict)    # layer -> (q [R,Hq,D], pos [R])
    log: dict = dataclasses.field(default_factory=dict)     # layer -> info
    probe: object = None        # positions of interest
    step: int = 0

def causal_probs(q, k, qpos, scale):
    # q [Hq,T,D], k [Hk,N,D]
    g = q.shape[0] // k.shape[0]
    kk = k.repeat_interleave(g, 0)
    s = torch.einsum("htd,hnd->htn", q.float(), kk.float()) * scale
    n = k.shape[1]
    s = s.masked_fill(torch.arange(n)[None, None, :] > qpos[None, :, None], float("-inf"))
    return s

def ls_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
    sim, lid = kw["ls_sim"], module.layer_idx   # the run's Sim, passed through the model's forward kwargs
    q, k, v = query[0], key[0], value[0]          # [Hq,T,D], [Hk,N,D]
    hq, t, d = q.shape
    hk, n, _ = k.shape
    g = hq // hk
    qpos = torch.arange(n - t, n)
    if t > 1:  # prefill (one segment: prefix 0 in the simulator)
        sim.prompt_len = n
        if lid in sim.capture:
            sim.cap[lid] = (q.clone(), k.clone(), scaling)
        kb, vb = k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()   # [N,Hk,D]
        slots = torch.arange(n)
        qr = q.transpose(0, 1)  # [T,Hq,D]
        sample = (sim.sampler or sample_query_rows)(t, sim.rows)
        vsum, vmax, ssum, smax = vs_estimate_reference(qr[sample], sample + (n - t), kb, slots, n, scaling)
        sel = vs_select(VSLineSums(vsum, vmax, ssum, smax, g, len(sample)), prefix_len=n - t,
                        config=VSSelectConfig(alpha=sim.alpha, sink_tokens=sim.sink, local_window=sim.local))
        if sim.force_v is not None:
            from flashinfer_ext.loopserve.vs_select import _compact
            vm = torch.zeros(hk, n, dtype=torch.bool)
            for h in range(hk):
                vm[h, sel.v_idx[h, : int(sel.v_cnt[h])].long()] = True
            vm[:, sim.force_v] = True
            sel.v_idx, sel.v_cnt = _compact(vm)
        vs = [sel.v_idx[h, : int(sel.v_cnt[h])].long() for h in range(hk)]
        ss = [sel.s_idx[h, : int(sel.s_cnt[h])].long() for h in range(hk)]
        sim.lines[lid] = (vs, ss)
        # dense attention of the LAST row (the one that predicts the first answer token): mass on probe positions
        s_last = causal_probs(q[:, -1:], k, qpos[-1:], scaling).softmax(-1)[:, 0]   # [Hq,N]
        info = {"v_cnt": sel.v_cnt.tolist(), "s_cnt": sel.s_cnt.tolist(), "cov_lb": sel.covered_lb.tolist()}
        if sim.probe is not None:
            pr = sim.probe
            info["last_row_dense_mass_probe"] = s_last[:, pr].sum(-1).view(hk, g).mean(1).tolist()
            info["probe_in_v"] = [int(torch.isin(pr, vs[h]).sum()) for h in range(hk)]
            info["sampled_vmass_probe"] = (vsum[:, pr].sum(1) / vsum.sum(1)).tolist()
        if sim.prefill == "dense":
            s = causal_probs(q, k, qpos, scaling)
            o = torch.einsum("htn,hnd->thd", s.softmax(-1), v.repeat_interleave(g, 0).float())
        else:
            o, _ = vs_prefill_reference(qr, kb, vb, slots, prefix_len=n - t, seq_len=n, v_idx=sel.v_idx,
                                        v_cnt=sel.v_cnt, s_idx=sel.s_idx, s_cnt=sel.s_cnt, sm_scale=scaling)
            if sim.cov_rows is not None:
                from flashinfer_ext.loopserve.reference import vs_mask_reference
                mfull = vs_mask_reference(n - t, n, sel.v_idx, sel.v_cnt, sel.s_idx, sel.s_cnt)  # [Hk,T,N]
                pd = causal_probs(q, k, qpos, scaling).softmax(-1).view(hk, g, t, n)
                cov = (pd * mfull[:, None]).sum(-1)  # [Hk,g,T]
                cr = sim.cov_rows
                missing = (pd[:, :, cr] * ~mfull[:, None, cr]).sum((1, 2))  # [Hk,N] mass missed by probe rows
                top = missing.topk(5, dim=1)
                info["cov_all"] = cov.mean((1, 2)).tolist(); info["cov_rows"] = cov[:, :, cr].mean((1, 2)).tolist()
                info["cov_rows_min"] = cov[:, :, cr].amin((1, 2)).tolist()
                info["missed_top"] = [[(int(i), round(float(x), 2)) for x, i in zip(top.values[h], top.indices[h])] for h in range(hk)]
            if sim.dense_rows is not None:
                dr = sim.dense_rows
                sd = causal_probs(q[:, dr], k, qpos[dr], scaling).softmax(-1)
                o[dr] = torch.einsum("htn,hnd->thd", sd, v.repeat_interleave(g, 0).float())
            # mass the sparse mask gives the probe for the last row
            if sim.probe is not None:
                from flashinfer_ext.loopserve.reference import vs_mask_reference
                m = vs_mask_reference(n - 1, n, sel.v_idx, sel.v_cnt, sel.s_idx, sel.s_cnt)[:, 0]  # [Hk,N]
                sl = causal_probs(q[:, -1:], k, qpos[-1:], scaling)[:, 0]
                sl = sl.masked_fill(~m.repeat_interleave(g, 0), float("-inf")).softmax(-1)
                info["last_row_sparse_mass_probe"] = sl[:, sim.probe].sum(-1).view(hk, g).mean(1).tolist()
        sim.log.setdefault(lid, {})["prefill"] = info
        sim.ring[lid] = (qr[-sim.n_d:].clone(), qpos[-sim.n_d:].clone())
        return o.to(query.dtype), None
    # decode step
    pos = n - 1
    qr = q.transpose(0, 1)  # [1,Hq,D]
    rq, rp = sim.ring[lid]
    rq, rp = torch.cat([rq, qr])[-sim.n_d:], torch.cat([rp, torch.tensor([pos])])[-sim.n_d:]
    sim.ring[lid] = (rq, rp)
    if sim.decode == "dense":
        mask = torch.ones(hk, n, dtype=torch.bool)
    else:
        n_o = n - sim.prompt_len
        vs, ss = sim.lines[lid]
        mask = torch.zeros(hk, n, dtype=torch.bool)
        mask[:, : sim.sink] = True
        for h in range(hk):
            mask[h, vs[h][vs[h] < n]] = True
            off = pos - ss[h]
            mask[h, off[off >= 0]] = True
        fire = (n_o >= 16 and (n_o - 16) % sim.n_d == 0) or (n_o < 16 and sim.initial_topb)
        st = sim.log.setdefault(lid, {})
        if fire:
            kb = k.transpose(0, 1).contiguous()
            top, score = decode_topb_reference(rq, rp, kb, torch.arange(n), n, scaling, sim.budget)
            st["topb"] = top
            st["since"] = pos
            if sim.probe is not None:
                st.setdefault("topb_probe", []).append([int(torch.isin(sim.probe, top[h]).sum()) for h in range(hk)])
        if "topb" in st:
            for h in range(hk):
                mask[h, st["topb"][h]] = True
            mask[:, st["since"]:] = True
        else:
            mask[:, sim.prompt_len:] = True
    s = causal_probs(q, k, torch.tensor([pos]), scaling)
    s = s.masked_fill(~mask.repeat_interleave(g, 0)[:, None, :], float("-inf")).softmax(-1)
    o = torch.einsum("htn,hnd->thd", s, v.repeat_interleave(g, 0).float())
    return o.to(query.dtype), None

AttentionInterface.register("ls", ls_attention)

class Probe:
    """The model and tokenizer of one probe session (fp32, the simulator's attention)."""

    def __init__(self, model_dir: str = MODEL):
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="ls").eval()

    def chat_ids(self, msgs, **template_kw) -> list[int]:
        """Token ids of ``msgs`` under the model's chat template (a plain list, whatever the tokenizer returns)."""
        ids = self.tok.apply_chat_template(msgs, tokenize=True, **template_kw)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def prompt_ids(self, task, turn=0):
        msgs = [{"role": "system", "content": task.system}, {"role": "user", "content": task.turns[turn].user},
                {"role": "assistant", "content": task.answer_prefix}]
        return self.chat_ids(msgs, continue_final_message=True)

    @torch.no_grad()
    def generate(self, ids, sim_kwargs, max_new=8, probe=None):
        """Greedy decode of ``max_new`` tokens under a fresh ``Sim(**sim_kwargs)``; returns (text, sim)."""
        from transformers import DynamicCache
        sim = Sim(**sim_kwargs)
        sim.probe = probe
        cache = DynamicCache()
        x = torch.tensor([ids])
        out = []
        for _ in range(max_new):
            logits = self.model(input_ids=x, past_key_values=cache, use_cache=True, ls_sim=sim).logits[0, -1]
            nxt = int(logits.argmax())
            out.append(nxt)
            if nxt == self.tok.eos_token_id:
                break
            x = torch.tensor([[nxt]])
        return self.tok.decode(out), sim
