"""Contract: LoopServe's batched decode re-selection (LoopServeRunner + sglang_sparse.loopserve.select, Alg. 3 /
Eq. 7) picks, for every
re-selecting row and layer, the top-min(budget, length) set of the fp32 reference over that row's own
observation queries (the ring's earlier ones + the current one; lastwindow: the prompt's last window over
the prompt's keys), keeps the other rows' earlier top-B, writes the new top-B back to the request state at
the next batch, and the kernel path (Triton under the interpreter on the CPU) decodes like the reference path.

Runs the runner on SGLang-shaped stand-ins (no sglang import): the shapes and names it reads from
SGLang's backend / ForwardBatch / Req."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from bench.loopserve_step_bench import DecodeMode
from flashinfer_ext.loopserve.reference import decode_topb_reference
from sglang_sparse.config import LastWindowConfig, LoopServeConfig
from sglang_sparse.loopserve.runner import STATE_ATTR, LoopServeRunner, ReqState
from sglang_sparse.loopserve.stats import STEP_COLS

from .kv_pool import make_pool

L, HQ, HK, D = 2, 4, 2, 64


_Mode = DecodeMode  # SGLang's ForwardMode of a decode batch (the bench's stand-in)


def _random_lines(plen, g, device, nv=12, ns=9):
    """Stored lines as a finished prefill leaves them: per (layer, KV head) ascending vertical positions and slash
    offsets below the prompt length, ``-1`` after their counts."""
    def one(n_max):
        idx = torch.full((L, HK, n_max), -1, dtype=torch.int32)
        cnt = torch.zeros(L, HK, dtype=torch.int32)
        for lid in range(L):
            for h in range(HK):
                n = int(torch.randint(0, n_max + 1, (1,), generator=g))
                idx[lid, h, :n] = torch.randperm(plen, generator=g)[:n].sort().values.to(torch.int32)
                cnt[lid, h] = n
        return idx.to(device), cnt.to(device)

    return (*one(nv), *one(ns))


def _setup(lastwindow, seq_lens, prompt_lens, budgets, seed=0, device="cpu", all_topb=False, lines=False):
    pool = make_pool(seq_lens, HQ, HK, D, torch.float32, 1, seed=seed, device=device)
    g = torch.Generator().manual_seed(seed + 1)
    k_bufs = [pool.k_buffer, torch.randn(pool.k_buffer.shape, generator=g).to(device)]
    v_bufs = [pool.v_buffer, torch.randn(pool.v_buffer.shape, generator=g).to(device)]
    backend = SimpleNamespace(
        token_to_kv_pool=SimpleNamespace(get_key_buffer=lambda i: k_bufs[i], get_value_buffer=lambda i: v_bufs[i]),
        req_to_token_pool=SimpleNamespace(req_to_token=pool.req_to_token))
    cfg = LastWindowConfig(window=8, budget=16, sink_tokens=4) if lastwindow else \
        LoopServeConfig(n_d=16, budget=16, sink_tokens=4)
    n_ring = 8 if lastwindow else 16
    reqs = []
    for b, (n, plen, bud) in enumerate(zip(seq_lens, prompt_lens, budgets)):
        none = torch.full((L, HK, 1), -1, dtype=torch.int32, device=device)
        cnt = torch.zeros(L, HK, dtype=torch.int32, device=device)
        st = ReqState(alpha=0.9, budget=bud, turn_start=0, prompt_len=plen, vmask=None, smask=None,
                      acc=torch.zeros(STEP_COLS, device=device),
                      ring=torch.randn(L, n_ring, HQ, D, generator=g).to(device),
                      ring_lo=max(plen - n_ring, 0) if lastwindow else 0, prefill_done=True,
                      lines=_random_lines(plen, g, device) if lines else (none, cnt, none.clone(), cnt.clone()))
        if all_topb or (b == len(seq_lens) - 1 and not lastwindow):  # rows that do not re-select now
            st.topb = torch.randint(0, plen, (L, HK, 5), generator=g, dtype=torch.int32).to(device)
        reqs.append(SimpleNamespace(sampling_params=SimpleNamespace(custom_params=None), origin_input_ids=[0] * plen,
                                    req_pool_idx=int(pool.req_pool_indices[b]), **{STATE_ATTR: st}))
    fb = SimpleNamespace(forward_mode=_Mode(), batch_size=len(seq_lens),
                         sampling_info=SimpleNamespace(sparse_reqs=reqs), seq_lens_cpu=torch.tensor(seq_lens),
                         req_pool_indices=pool.req_pool_indices.long())
    q3 = torch.randn(len(seq_lens), HQ, D, generator=g).to(device)
    shape = SimpleNamespace(num_layers=L, num_kv_heads=HK, num_qo_heads=HQ, head_dim=D)
    return cfg, shape, backend, fb, reqs, q3, pool


def _run(lastwindow, use_kernels, seq_lens, prompt_lens, budgets, device="cpu", all_topb=False, split_keys=None,
         lines=False):
    cfg, shape, backend, fb, reqs, q3, pool = _setup(lastwindow, seq_lens, prompt_lens, budgets,
                                                     device=device, all_topb=all_topb, lines=lines)
    old_topb = [None if getattr(r, STATE_ATTR).topb is None else getattr(r, STATE_ATTR).topb.clone() for r in reqs]
    rings = [getattr(r, STATE_ATTR).ring.clone() for r in reqs]
    runner = LoopServeRunner(cfg, shape, torch.device(device), use_kernels=use_kernels)
    if split_keys is not None:  # the LSE pass in key spans of this many keys (as long contexts have)
        runner.lse_split_keys = split_keys
    runner.begin_batch(backend, fb)
    o3 = torch.zeros(len(seq_lens), HQ, D, device=device)
    for lid in range(L):
        runner.decode(backend, o3, q3, SimpleNamespace(layer_id=lid, scaling=D ** -0.5))
    return runner, o3, dict(cfg=cfg, backend=backend, fb=fb, reqs=reqs, q3=q3, pool=pool, old_topb=old_topb,
                            rings=rings)


# seq_lens, prompt lens, budgets: rows 0-1 re-select (initial top-B at generated token 5; Alg. 3's
# first at token 16), row 2 (generated token 20) keeps its top-B; budget 200 > length caps at the length
LOOPSERVE = ([300, 140, 90], [296, 125, 71], [32, 200, 8])
LASTWINDOW = ([300, 41, 90], [299, 40, 89], [32, 200, 16])  # first decode step: every row selects once


def _check_reselection(lastwindow, use_kernels, device="cpu", split_keys=None):
    """On the CPU the selected sets equal the reference's; on a GPU (fp32 keys but tf32 dots: not
    bit-equal) every selected position scores within 1e-3 of the reference's ``keep``-th score."""
    seq_lens, prompt_lens, budgets = LASTWINDOW if lastwindow else LOOPSERVE
    runner, _, env = _run(lastwindow, use_kernels, seq_lens, prompt_lens, budgets, device=device,
                          split_keys=split_keys)
    d = runner.dec
    assert (d["sel"]["num_splits"] > 1) == (split_keys is not None)
    fires = [True, True, lastwindow]
    assert d["fire"] == fires
    pool, reqs = env["pool"], env["reqs"]
    rtt, rpi = pool.req_to_token.cpu(), pool.req_pool_indices.cpu()
    for j, (n, plen, bud) in enumerate(zip(seq_lens, prompt_lens, budgets)):
        st = getattr(reqs[j], STATE_ATTR)
        for lid in range(L):
            got = d["topb"][j, lid].cpu()
            if not fires[j]:
                old = env["old_topb"][j][lid].cpu()
                if "sel_lists" in d:  # kernel path: the kept top-B came with the row's base (lines, top-B, sink)
                    assert (got == -1).all()
                    lists, lens = d["sel_lists"][0][lid, j].cpu(), d["sel_lists"][1][lid, j].cpu()
                    for h in range(HK):
                        assert {x for x in old[h].tolist() if x >= 0} <= set(lists[h, : int(lens[h])].tolist())
                else:
                    assert torch.equal(got[:, : old.shape[1]], old)
                continue
            ring = env["rings"][j][lid].cpu()
            if lastwindow:
                obs_pos = torch.arange(st.ring_lo, plen)
                q_obs, hi = ring[obs_pos % ring.shape[0]], plen
            else:
                obs_pos = torch.arange(max(0, n - 16), n)
                q_obs = torch.cat([ring[obs_pos[:-1] % 16], env["q3"][j: j + 1].cpu()])
                hi = n
            k_buf = env["backend"].token_to_kv_pool.get_key_buffer(lid).cpu()
            want, score = decode_topb_reference(q_obs, obs_pos, k_buf, rtt[rpi[j].long()], hi, D ** -0.5, bud)
            keep = min(bud, hi)
            if lastwindow:  # SnapKV: scores averaged over 7 neighbours (the edges over fewer), candidates
                # before the observation window, never the sink
                cand = st.ring_lo
                pooled = torch.stack([torch.stack([score[h, max(0, k - 3): k + 4].mean() for k in range(hi)])
                                      for h in range(HK)])
                pooled[:, : runner.cfg.sink_tokens] = -1.0
                score = pooled[:, :cand]
                keep = min(bud, cand)
                want = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :keep]
                hi = cand
            for h in range(HK):
                row = got[h].tolist()
                assert all(x == -1 for x in row[keep:])
                if device == "cpu":
                    assert set(row[:keep]) == set(want[h].tolist())
                else:
                    assert len(set(row[:keep])) == keep and all(0 <= x < hi for x in row[:keep])
                    kth = score[h].sort(descending=True).values[keep - 1]
                    assert float(score[h][row[:keep]].min()) >= float(kth) - 1e-3 * float(score[h].max())
    # the new top-B reaches the request states at the next batch (one copy per row)
    runner.begin_batch(env["backend"], SimpleNamespace(forward_mode=_Mode(), batch_size=0, sampling_info=None))
    for j, (n, plen, bud) in enumerate(zip(seq_lens, prompt_lens, budgets)):
        if fires[j]:
            st = getattr(reqs[j], STATE_ATTR)
            assert st.topb.shape == (L, HK, min(bud, st.ring_lo if lastwindow else n))
            assert torch.equal(st.topb, d["topb"][j, :, :, : st.topb.shape[2]])


@pytest.mark.parametrize("use_kernels", [False, True], ids=["reference", "kernel"])
@pytest.mark.parametrize("lastwindow", [False, True], ids=["loopserve", "lastwindow"])
def test_batched_reselection_picks_each_rows_reference_top_b(lastwindow, use_kernels):
    _check_reselection(lastwindow, use_kernels)


@pytest.mark.parametrize("lastwindow", [False, True], ids=["loopserve", "lastwindow"])
def test_batched_reselection_with_the_lse_pass_in_key_spans_picks_the_reference_top_b(lastwindow):
    _check_reselection(lastwindow, True, split_keys=64)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("split_keys", [None, 64], ids=["one_pass", "key_spans"])
@pytest.mark.parametrize("lastwindow", [False, True], ids=["loopserve", "lastwindow"])
def test_gpu_batched_reselection_picks_each_rows_reference_top_b(lastwindow, split_keys):
    _check_reselection(lastwindow, True, device="cuda", split_keys=split_keys)


@pytest.mark.parametrize("lastwindow", [False, True], ids=["loopserve", "lastwindow"])
def test_kernel_path_decodes_like_the_reference_path(lastwindow):
    seq_lens, prompt_lens, budgets = LASTWINDOW if lastwindow else LOOPSERVE
    ref_runner, o_ref, _ = _run(lastwindow, False, seq_lens, prompt_lens, budgets)
    ker_runner, o_ker, _ = _run(lastwindow, True, seq_lens, prompt_lens, budgets)
    # the lists are split as if graph_list_width (2048 / 8192) wide: the split-list decode ran
    assert ker_runner.dec["split"].num_splits > 1
    assert torch.equal(ref_runner.step_rows, ker_runner.step_rows)  # same token sets read
    torch.testing.assert_close(o_ker, o_ref, rtol=1e-4, atol=1e-4)
    assert float(o_ref.abs().sum()) > 0


# no row re-selects: loopserve rows at generated tokens 30, 40, 19 (Alg. 3 fires at 16, 32, ...), lastwindow
# rows past their first decode step; every row carries its earlier top-B
STEADY = {False: ([300, 140, 90], [270, 100, 71], [32, 200, 8]), True: ([300, 41, 90], [290, 30, 80], [32, 200, 16])}


def _check_steady_step(lastwindow, device="cpu", tol=1e-4, all_layers=True):
    """A step where no row re-selects plans all layers' token lists in begin_batch (``lists_all``, layer-major,
    from the requests' sorted bases with no position twice); each layer then attends exactly the union of lines,
    slash offsets, kept top-B, sink and tail (the definition, :func:`decode_union_mask`, built from the request
    states), on the reference and the kernel path alike (``tol``: the kernel's fp32 dots are tf32 on a GPU)."""
    from flashinfer_ext.loopserve.reference import masked_decode_reference
    from flashinfer_ext.common.sparse_decode import decode_union_mask
    from sglang_sparse.loopserve.lists import union_lists
    from sglang_sparse.loopserve.runner import _pad

    seq_lens, prompt_lens, budgets = STEADY[lastwindow]
    outs = []
    for use_kernels in (False, True):
        runner, o3, env = _run(lastwindow, use_kernels, seq_lens, prompt_lens, budgets, device=device,
                               all_topb=True)
        d = runner.dec
        assert d["fire"] == [False] * len(seq_lens) and d["sel"] is None
        assert ("lists_all" in d) == all_layers
        if all_layers:
            lists, lens = d["lists_all"]
            assert lists.shape[:3] == (L, len(seq_lens), HK) and lists[0].is_contiguous()
            # the kernel path plans from the requests' sorted bases (loopserve.lists.steady_lists, a Triton kernel);
            # the reference path (a CPU server) sorts every layer's candidates in torch
            assert (d["v"] is None) == use_kernels
            for lid in range(L):
                for j in range(len(seq_lens)):
                    for h in range(HK):
                        got = lists[lid, j, h, : int(lens[lid, j, h])].tolist()
                        assert len(got) == len(set(got)), "a position twice"
            sts = d["states"]
            v = _pad([st.lines[0] for st in sts], max(st.lines[0].shape[2] for st in sts), runner.shape, device)
            s_ = _pad([st.lines[2] for st in sts], max(st.lines[2].shape[2] for st in sts), runner.shape, device)
            tb = _pad([st.topb for st in sts], max(st.topb.shape[2] for st in sts), runner.shape, device)
        else:  # over the size cap: built per layer, the same sets
            built = [union_lists(d, lid, runner.cfg.sink_tokens) for lid in range(L)]
            lens = torch.stack([b[1] for b in built])
            v, s_, tb = d["v"], d["s"], d["topb"]
        pool, q3 = env["pool"], env["q3"]
        read = torch.zeros(len(seq_lens), device=device)
        for lid in range(L):
            mask = decode_union_mask(v[:, lid], s_[:, lid], tb[:, lid], d["pos"], d["since"],
                                     d["seq"], sink_tokens=runner.cfg.sink_tokens, max_len=d["max_len"])
            assert torch.equal(lens[lid], mask.sum(2, dtype=torch.int32))
            read += mask.sum((1, 2)).float()
            k_buf = env["backend"].token_to_kv_pool.get_key_buffer(lid)
            v_buf = env["backend"].token_to_kv_pool.get_value_buffer(lid)
            want = masked_decode_reference(q3, k_buf, v_buf, pool.req_to_token, pool.req_pool_indices, mask,
                                           D ** -0.5)
            if lid == L - 1:  # o3 holds the last layer's output
                torch.testing.assert_close(o3, want, rtol=tol, atol=tol)
        from sglang_sparse.loopserve.stats import COL_READ

        assert torch.equal(runner.step_rows[:, COL_READ].cpu(), read.cpu())
        outs.append(o3)
    torch.testing.assert_close(outs[1], outs[0], rtol=tol, atol=tol)


@pytest.mark.parametrize("lastwindow", [False, True], ids=["loopserve", "lastwindow"])
def test_step_without_reselection_builds_every_layers_sets_once_and_decodes_them(lastwindow):
    _check_steady_step(lastwindow)


@pytest.mark.parametrize("lastwindow", [False, True], ids=["loopserve", "lastwindow"])
def test_step_without_reselection_over_the_size_cap_builds_sets_per_layer(lastwindow, monkeypatch):
    import sglang_sparse.loopserve.runner as lr

    monkeypatch.setattr(lr, "LISTS_ALL_MAX_ENTRIES", 0)
    _check_steady_step(lastwindow, all_layers=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("lastwindow", [False, True], ids=["loopserve", "lastwindow"])
def test_gpu_step_without_reselection_builds_every_layers_sets_once_and_decodes_them(lastwindow):
    _check_steady_step(lastwindow, device="cuda", tol=2e-3)


def test_reselecting_step_on_the_kernel_path_attends_lines_slashes_top_b_sink_and_tail():
    """A re-selecting step on the kernel path builds every layer's lists from the rows' bases (a re-selecting row's
    without its old top-B), slash keys and tail, and each layer appends its new top-B (loopserve.lists.select_lists):
    every list holds no position twice and is exactly the union the definition gives (decode_union_mask over the
    stored lines, the new top-B of the re-selecting rows and the kept top-B of the others), and the decode equals
    the reference path's."""
    from flashinfer_ext.common.sparse_decode import decode_union_mask
    from sglang_sparse.loopserve.runner import _pad

    seq_lens, prompt_lens, budgets = LOOPSERVE
    ref, o_ref, _ = _run(False, False, seq_lens, prompt_lens, budgets, lines=True)
    ker, o_ker, env = _run(False, True, seq_lens, prompt_lens, budgets, lines=True)
    d = ker.dec
    assert "sel_lists" in d and d["fire"] == [True, True, False]
    sts = d["states"]
    assert sum(int(st.lines[1].sum() + st.lines[3].sum()) for st in sts) > 0  # lines to merge
    v = _pad([st.lines[0] for st in sts], max(st.lines[0].shape[2] for st in sts), ker.shape, "cpu")
    s_ = _pad([st.lines[2] for st in sts], max(st.lines[2].shape[2] for st in sts), ker.shape, "cpu")
    kept = [None if f else old for f, old in zip(d["fire"], env["old_topb"])]
    topb = torch.where(d["topb"] >= 0, d["topb"], _pad(kept, d["topb"].shape[3], ker.shape, "cpu"))
    for lid in range(L):
        lists, lens = d["sel_lists"][0][lid], d["sel_lists"][1][lid]  # after the forward: with the new top-B
        mask = decode_union_mask(v[:, lid], s_[:, lid], topb[:, lid], d["pos"], d["since"], d["seq"],
                                 sink_tokens=ker.cfg.sink_tokens, max_len=d["max_len"])
        for j in range(len(seq_lens)):
            for h in range(HK):
                got = lists[j, h, : int(lens[j, h])].tolist()
                assert len(got) == len(set(got)), "a position twice"
                assert sorted(got) == torch.nonzero(mask[j, h]).flatten().tolist()
    torch.testing.assert_close(o_ker, o_ref, rtol=1e-4, atol=1e-4)
