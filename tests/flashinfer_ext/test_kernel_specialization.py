"""Contract: a new prompt length compiles no new Triton kernel variant on the sparse modes' eager paths.

Triton compiles one binary per *specialization* of a kernel's arguments: an int equal to 1 becomes a constant and an
int or pointer divisible by 16 gets an alignment hint. An argument that follows the prompt length (a row count, a
list width, a stride of a length-sized buffer) therefore makes requests of new lengths compile new binaries, each a
stall of about a second in the request's time to first token, for as long as new combinations keep arriving. The
arguments that follow the length are marked ``do_not_specialize``.

LoopServe's engaged prefill (line estimation), its key-span LSE pass, its eager re-selecting decode step (scoring,
top-B, the decode lists, the split decode) and PSA's decode run here through the Triton interpreter at several
context lengths; every launch's arguments are keyed with Triton's own specialization function
(``native_specialize_impl``, honouring the kernel's ``do_not_specialize`` lists), and every length must need the
same set of compiled variants."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

triton = pytest.importorskip("triton")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from sglang_sparse.config import LoopServeConfig  # noqa: E402
from sglang_sparse.loopserve.runner import LoopServeRunner  # noqa: E402

from .kv_pool import layered_backend, make_pool  # noqa: E402

L, HQ, HK, D = 2, 4, 2, 64
CONTEXT = 512  # the served context length: req_to_token's row length, the same for every request


def _keys(fn: InterpretedFunction, args: tuple, kwargs: dict) -> dict:
    """``{param: specialization key}`` of one launch, as the compiled launcher would key it."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl

    import inspect

    params = inspect.signature(fn.fn).parameters
    dns = set(fn.kwargs.get("do_not_specialize") or ())
    dns_oa = set(fn.kwargs.get("do_not_specialize_on_alignment") or ())
    bound = dict(zip(fn.arg_names, args))
    bound.update(kwargs)
    out = {}
    for i, name in enumerate(fn.arg_names):
        if name not in bound or "constexpr" in str(params[name].annotation):  # constexprs are keyed by value
            continue
        v = bound[name]
        if isinstance(v, float):
            continue
        spec = not (name in dns or i in dns)
        align = not (name in dns_oa or i in dns_oa)
        out[name] = native_specialize_impl(BaseBackend, v, False, spec, align)
    return out


def _record(monkeypatch) -> list:
    launches = []
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        launches.append((self.fn.__name__, _keys(self, args, kwargs)))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recording_run)
    return launches


def _engaged_prefill(prompt: int, chunk: int, seed: int = 0) -> None:
    """A ``prompt``-token request through the runner's kernel path in chunks of ``chunk``, every chunk estimating
    and selecting lines (``line_chunks: all``), then its decode lists built."""
    pool = make_pool([prompt], HQ, HK, D, torch.float32, 1, seed=seed, max_context_len=CONTEXT)
    backend, g = layered_backend(pool, L, seed + 7)
    cfg = LoopServeConfig(min_context=64, alpha=0.9, sink_tokens=4, local_window=16, sampled_rows=16,
                          line_chunks="all")
    shape = SimpleNamespace(num_layers=L, num_kv_heads=HK, num_qo_heads=HQ, head_dim=D)
    runner = LoopServeRunner(cfg, shape, torch.device("cpu"), use_kernels=True)
    req = SimpleNamespace(sampling_params=SimpleNamespace(custom_params=None), origin_input_ids=[0] * prompt,
                          req_pool_idx=int(pool.req_pool_indices[0]))
    q_all = torch.randn(L, prompt, HQ, D, generator=g)
    mode = SimpleNamespace(is_idle=lambda: False, is_decode=lambda: False, is_extend=lambda: True)
    for prefix in range(0, prompt, chunk):
        ext = min(chunk, prompt - prefix)
        fb = SimpleNamespace(forward_mode=mode, batch_size=1, seq_lens_cpu=torch.tensor([prefix + ext]),
                             extend_seq_lens_cpu=[ext], extend_prefix_lens_cpu=[prefix],
                             req_pool_indices_cpu=pool.req_pool_indices.cpu(),
                             sampling_info=SimpleNamespace(sparse_reqs=[req]))
        runner.begin_batch(backend, fb)
        for lid in range(L):
            q3 = q_all[lid, prefix: prefix + ext]
            runner.extend(backend, torch.zeros_like(q3), q3, SimpleNamespace(layer_id=lid, scaling=D ** -0.5))
        runner.finish_extend(backend)


def _length_dependent(runs: list[list]) -> dict:
    """``{kernel: [params]}`` whose keys make some run (one context length) need a compiled variant another run does
    not: each run's set of (kernel, keys) variants must be the same."""
    variants = [{(name, tuple(sorted(keys.items()))) for name, keys in launches} for launches in runs]
    odd = set().union(*variants) - set.intersection(*variants)
    out: dict = {}
    for name, keys in odd:
        for other_name, other in set().union(*variants):
            if other_name == name and other != keys:
                out.setdefault(name, set()).update(p for (p, k), (_, k2) in zip(keys, other) if k != k2)
    return {k: sorted(v) for k, v in out.items()}


def _runs(launches: list, mark: list) -> list[list]:
    return [launches[a:b] for a, b in zip(mark, mark[1:] + [len(launches)])]


def test_new_prompt_lengths_compile_no_new_kernel_variants(monkeypatch):
    launches, mark = _record(monkeypatch), []
    # lengths whose sizes differ in what Triton keys (divisible by 16 or not); the last chunk's length varies too
    for prompt in (288, 301, 305, 320, 337):
        mark.append(len(launches))
        _engaged_prefill(prompt, chunk=96)
    assert "_lines_kernel" in {name for name, _ in launches}, "the kernel path launched no line estimation"
    varying = _length_dependent(_runs(launches, mark))
    assert not varying, f"arguments whose specialization follows the prompt length (mark them do_not_specialize): {varying}"


@pytest.mark.parametrize("hq,hk", [(HQ, HK), (9, 3)], ids=["gqa2", "smollm2_heads"])
def test_line_estimation_with_key_spans_compiles_no_new_variant_per_length(monkeypatch, hq, hk):
    """Long contexts split the LSE pass into key spans (one more launch, the merge): the same contract there, also
    with SmolLM2's 3 KV heads (the line-sum outputs then sit at offsets whose alignment follows the length's parity)."""
    from flashinfer_ext.loopserve.vs_estimate import vs_estimate

    launches, mark = _record(monkeypatch), []
    g = torch.Generator().manual_seed(3)
    for seq_len in (256, 301, 333, 352):
        mark.append(len(launches))
        k = torch.randn(512, hk, D, generator=g)
        q = torch.randn(16, hq, D, generator=g)
        pos = torch.arange(seq_len - 16, seq_len, dtype=torch.int64)
        slots = torch.randperm(512, generator=g).to(torch.int32)  # a request's req_to_token row: context-sized
        vs_estimate(q, pos, k, slots, seq_len, sm_scale=D ** -0.5, target_programs=64, min_split_keys=32)
    seen = {name for name, _ in launches}
    assert {"_batched_lse_split_kernel", "_lse_merge_kernel"} <= seen, sorted(seen)
    varying = _length_dependent(_runs(launches, mark))
    assert not varying, f"arguments whose specialization follows the context length: {varying}"


def test_line_selection_split_search_compiles_no_new_variant_per_length(monkeypatch):
    """The alpha-coverage selection's split search (one Triton launch on the GPU; the CPU runner takes its torch
    reference, so it is driven here directly) at several context lengths."""
    from flashinfer_ext.loopserve.vs_estimate import vs_estimate
    from flashinfer_ext.loopserve.vs_select import VSSelectConfig, vs_select

    launches, mark = _record(monkeypatch), []
    g = torch.Generator().manual_seed(4)
    for seq_len in (256, 301, 333, 352):
        k = torch.randn(512, HK, D, generator=g)
        q = torch.randn(16, HQ, D, generator=g)
        slots = torch.randperm(512, generator=g).to(torch.int32)
        lines = vs_estimate(q, torch.arange(seq_len - 16, seq_len), k, slots, seq_len, sm_scale=D ** -0.5)
        mark.append(len(launches))
        vs_select(lines, prefix_len=seq_len - 64, config=VSSelectConfig(alpha=0.9, local_window=16),
                  use_kernel=True)
    assert "_split_search_kernel" in {name for name, _ in launches}
    varying = _length_dependent(_runs(launches, mark))
    assert not varying, f"arguments whose specialization follows the context length: {varying}"


def test_re_selecting_decode_steps_compile_no_new_variant_per_length(monkeypatch):
    """The eager decode steps that re-select (every step before generated token 16 with ``initial_topb``, then every
    ``n_d``): scoring, top-B, the decode lists and the split decode, at several context lengths."""
    import functools

    from . import test_loopserve_reselect as rs

    monkeypatch.setattr(rs, "make_pool", functools.partial(make_pool, max_context_len=CONTEXT))
    launches, mark = _record(monkeypatch), []
    for n in (288, 301, 305, 320, 337):
        mark.append(len(launches))
        runner, _, _ = rs._run(False, True, [n, n - 40], [n - 4, n - 45], [32, 24], lines=True)
        assert all(runner.dec["fire"])
    seen = {name for name, _ in launches}
    assert {"_batched_vsum_kernel", "_lines_union_kernel", "_split_kernel"} <= seen, sorted(seen)
    varying = _length_dependent(_runs(launches, mark))
    assert not varying, f"arguments whose specialization follows the context length: {varying}"


def test_psa_decode_compiles_no_new_variant_per_length(monkeypatch):
    """PSA's decode (metadata update, criticality, ranking, waves and merge) at several context lengths."""
    from flashinfer_ext.psa.config import PsaDecodeConfig

    from .test_psa_decode import build

    launches, mark = _record(monkeypatch), []
    cfg = PsaDecodeConfig(epsilon=0.9, micro_batch_blocks=2, sink_blocks=1, local_blocks=1, max_blocks=64,
                          chunk_growth=2)
    for n in (288, 301, 305, 320, 337):
        mark.append(len(launches))
        pool = make_pool([n, n - 37], 8, 2, 64, torch.bfloat16, 16, seed=5, planted=True, max_context_len=CONTEXT)
        w, mp, _ = build(pool, cfg, 16, max_batch_size=4, wave_programs=2)
        w.run(pool.q, pool.k_buffer, pool.v_buffer, *mp.layer(0))
    seen = {name for name, _ in launches}
    assert {"_wave_merge_kernel", "_rank_select_kernel", "_criticality_kernel"} <= seen, sorted(seen)
    varying = _length_dependent(_runs(launches, mark))
    assert not varying, f"arguments whose specialization follows the context length: {varying}"


def _sorted_lists(g: torch.Generator, rows: int, hk: int, width: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[rows, hk, width]`` int32 ascending distinct positions below ``hi`` (a list per row and KV head), full."""
    lists = torch.stack([torch.stack([torch.randperm(hi, generator=g)[:width].sort().values for _ in range(hk)])
                         for _ in range(rows)]).to(torch.int32)
    return lists, torch.full((rows, hk), width, dtype=torch.int32)


def test_new_line_counts_compile_no_new_list_or_decode_variant(monkeypatch):
    """The decode lists' widths follow each request's selected lines (how many vertical and slash lines cover
    ``alpha``), not only its length: the list kernels (union of lines, top-B appends) and the split decode over
    lists of those widths, at one context length, must need the same variants whatever the line counts."""
    from flashinfer_ext.common.split_decode import plan_splits, sparse_decode_split
    from flashinfer_ext.loopserve.lines_union import lines_append, lines_union
    from flashinfer_ext.loopserve.list_union import union_append

    launches, mark = _record(monkeypatch), []
    g = torch.Generator().manual_seed(6)
    n, rows = 320, 2
    seq = torch.tensor([n, n - 7], dtype=torch.int32)
    since = seq - 3
    pool = make_pool([n, n - 7], HQ, HK, D, torch.bfloat16, 1, seed=6, max_context_len=CONTEXT)
    for wa, ws in ((40, 16), (41, 17), (48, 3), (57, 1), (64, 32)):  # vertical / slash line counts of a request
        mark.append(len(launches))
        base, base_lens = _sorted_lists(g, rows, L * HK, wa, n - 8)
        base, base_lens = base.view(rows, L, HK, wa), base_lens.view(rows, L, HK)
        s_idx = torch.stack([torch.randperm(n - 8, generator=g)[:ws] for _ in range(rows * L * HK)]).view(
            rows, L, HK, ws).sort(dim=-1).values.to(torch.int32)
        marks = torch.empty(L, rows, HK, 2, dtype=torch.int32)
        lists, lens = lines_union(base, base_lens, s_idx, since, seq, max_since=8, marks_out=marks,
                                  out=torch.zeros(L, rows, HK, wa + ws + 8 + 16, dtype=torch.int32), zero_fill=False)
        extra = torch.stack([torch.randperm(n - 8, generator=g)[:16] for _ in range(rows * HK)]).view(
            rows, HK, 16).to(torch.int32)
        lines_append(lists[0], lens[0], marks[0], since, seq, extra)
        top, top_lens = _sorted_lists(g, rows, HK, wa, n - 8)
        union_append(top, top_lens, extra, seq)
        width = int(lens[0].max())
        plan = plan_splits(width, rows * HK, block_size=1, target_programs=8)
        sparse_decode_split(pool.q, pool.k_buffer, pool.v_buffer, pool.req_to_token, pool.req_pool_indices,
                            seq, lists[0][..., :width].contiguous(), lens[0], plan, block_size=1, sm_scale=D ** -0.5)
    seen = {name for name, _ in launches}
    assert {"_lines_union_kernel", "_lines_append_kernel", "_union_append_kernel", "_split_kernel",
            "_merge_kernel"} <= seen, sorted(seen)
    varying = _length_dependent(_runs(launches, mark))
    assert not varying, f"arguments whose specialization follows the line counts (mark them do_not_specialize): {varying}"
