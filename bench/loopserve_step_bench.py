"""Where an eager LoopServe decode step spends its time: the runner alone, on synthetic SGLang-shaped state.

Runs :class:`sglang_sparse.loopserve.runner.LoopServeRunner` (the server's code, no server) for one decode step
of ``batch`` requests over every layer: ``begin_batch`` (the per-step planning) then ``decode`` per layer (the
attention the backend runs in place of the stock one), for two kinds of step:

* ``selecting``: every row selects top-B at this step (Alg. 3's re-selection, and every step of the first 16
  with ``initial_topb``): the batched estimation + top-B + list merge run per layer, eagerly;
* ``steady``: no row selects (15 of every 16 steps after token 16): every layer's lists are built in
  ``begin_batch`` from the requests' sorted bases; in a server with decode graphs this step's ``decode`` calls are
  a graph replay. ``steady_sorted``: the same step with the sort-based list build it replaced.

Per kind it reports the median wall time of the step with a device sync at its end (``step_ms``), the host
time to issue it (``host_ms``: until the last call returns, no sync: the launch-bound part), its planning
alone (``plan_ms``), and from one profiled step the kernel launches and the GPU kernel time. State: random
post-RoPE keys per layer, random line sets (``lines`` vertical + ``lines`` slash per layer and KV head), the
last ``n_d`` queries in the rings. No model, no scheduler: the model's own layers (stock kernels, the same in
every mode) are not in these figures.

    python bench/loopserve_step_bench.py --out DIR            # GPU: DIR/loopserve_step.{json,md}
    python bench/loopserve_step_bench.py --out DIR --smoke    # CPU (Triton interpreter), tiny shapes, no claim
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

if not torch.cuda.is_available():  # the kernel path runs under the Triton interpreter on a CPU machine
    os.environ.setdefault("TRITON_INTERPRET", "1")
if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (name, layers, qo heads, kv heads, head dim, batch, context, budget, lines per kind)
CASES = [("smollm2_b1", 30, 9, 3, 64, 1, 2700, 64, 64), ("smollm2_b8", 30, 9, 3, 64, 8, 2700, 64, 64),
         ("llama8b_b8_32k", 32, 32, 8, 128, 8, 32768, 1024, 256),
         ("llama8b_b1_32k", 32, 32, 8, 128, 1, 32768, 1024, 256),
         ("llama8b_b1_128k", 32, 32, 8, 128, 1, 131072, 1024, 256),
         # the 32k testbed's shapes: lines ~16 % of the context at the default alpha (loopserve_prefill.json real_32k)
         ("smollm2_b8_32k", 30, 9, 3, 64, 8, 32768, 1024, 2560),
         ("smollm2_b32_32k", 30, 9, 3, 64, 32, 32768, 1024, 2560)]
# kinds: a re-selecting step (its LSE pass in key spans of the runner's lse_split_keys), the same step with
# the LSE pass in one span ("selecting_unsplit", for the ratio), a
# steady step (lists from the requests' sorted bases, loopserve.lists.steady_lists) and the same step with the
# sort-based build ("steady_sorted": the code before, for the ratio)
KINDS = ("selecting", "selecting_unsplit", "selecting_sorted", "selecting_graph", "steady", "steady_sorted")
# "selecting_sorted": a re-selecting step with the sort-based lists (the code before the per-layer lists from the
# rows' bases, for the ratio); "selecting_graph" (CUDA only): the same step replayed from the re-selecting CUDA
# graph (loopserve.graph), every row selecting, step = the graph's planning + one replay of every layer
SMOKE = [("smoke", 2, 4, 2, 64, 2, 300, 16, 8)]


class DecodeMode:
    """Stand-in for SGLang's ``ForwardMode`` of a decode batch (the three questions the runner asks)."""

    def is_idle(self):
        return False

    def is_decode(self):
        return True

    def is_extend(self):
        return False


def build(case, kind: str, dev: torch.device, seed: int = 0):
    """Runner + backend / forward-batch stand-ins with the attribute names the runner reads."""
    from sglang_sparse.config import LoopServeConfig
    from sglang_sparse.loopserve.runner import STATE_ATTR, LoopServeRunner, ReqState
    from sglang_sparse.loopserve.stats import STEP_COLS

    _, n_l, hq, hk, d, batch, ctx, budget, n_lines = case
    g = torch.Generator(device=dev).manual_seed(seed)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    slots = batch * ctx
    k_bufs = [torch.randn(slots, hk, d, device=dev, generator=g, dtype=dt) for _ in range(n_l)]
    v_bufs = [torch.randn(slots, hk, d, device=dev, generator=g, dtype=dt) for _ in range(n_l)]
    rtt = torch.randperm(slots, device=dev, generator=g).to(torch.int32).view(batch, ctx).contiguous()
    backend = SimpleNamespace(
        token_to_kv_pool=SimpleNamespace(get_key_buffer=lambda i: k_bufs[i], get_value_buffer=lambda i: v_bufs[i]),
        req_to_token_pool=SimpleNamespace(req_to_token=rtt))
    cfg = LoopServeConfig(n_d=16, budget=budget, sink_tokens=4, min_context=128)
    selecting = kind.startswith("selecting")
    n_o = 5 if selecting else 20  # generated tokens: initial top-B phase vs between re-selections
    plen = ctx - n_o
    reqs = []
    for b in range(batch):
        def lines():
            idx = torch.sort(torch.rand(n_l, hk, plen, device=dev, generator=g).topk(n_lines, dim=2).indices,
                             dim=2).values.to(torch.int32)
            return idx.contiguous(), torch.full((n_l, hk), n_lines, dtype=torch.int32, device=dev)
        v_idx, v_cnt = lines()
        s_idx, s_cnt = lines()
        st = ReqState(alpha=0.97, budget=budget, turn_start=0, prompt_len=plen, vmask=None, smask=None,
                      acc=torch.zeros(STEP_COLS, device=dev),
                      ring=torch.randn(n_l, cfg.n_d, hq, d, device=dev, generator=g, dtype=dt),
                      ring_lo=plen - cfg.n_d, prefill_done=True, lines=(v_idx, v_cnt, s_idx, s_cnt),
                      since=0 if selecting else plen + 16)
        if kind.startswith("steady"):
            st.topb = torch.randint(0, plen, (n_l, hk, budget), device=dev, generator=g, dtype=torch.int32)
        reqs.append(SimpleNamespace(sampling_params=SimpleNamespace(custom_params=None), origin_input_ids=[0] * plen,
                                    req_pool_idx=b, **{STATE_ATTR: st}))
    fb = SimpleNamespace(forward_mode=DecodeMode(), batch_size=batch, sampling_info=SimpleNamespace(sparse_reqs=reqs),
                         seq_lens_cpu=torch.full((batch,), ctx), req_pool_indices=torch.arange(batch, device=dev))
    runner = LoopServeRunner(cfg, SimpleNamespace(num_layers=n_l, num_kv_heads=hk, num_qo_heads=hq, head_dim=d),
                             dev, use_kernels=True)
    if kind == "selecting_unsplit":
        runner.lse_split_keys = 1 << 30  # one key span: the LSE pass unsplit
    elif kind in ("steady_sorted", "selecting_sorted"):
        runner.steady_from_bases = False
    if kind != "selecting_unsplit" and dev.type != "cuda":  # the smoke case: short spans, so that the split path
        runner.lse_split_keys = 64                          # runs under the interpreter
    q3 = torch.randn(batch, hq, d, device=dev, generator=g, dtype=dt)
    layers = [SimpleNamespace(layer_id=i, scaling=d ** -0.5) for i in range(n_l)]
    o3 = torch.empty_like(q3)
    return runner, backend, fb, q3, o3, layers


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _graph_step(runner, backend, fb, q3, o3, layers):
    """The re-selecting step as a server replays it: :class:`LoopServeGraphs` captures every layer's decode over
    its static buffers into a CUDA graph (the re-selecting variant); ``(plan, step)`` = the replay's planning
    alone, planning + replay."""
    from sglang.srt.model_executor.runner_utils.capture_mode import _set_capture_lora_variant

    from sglang_sparse.graph_variants import SELECT
    from sglang_sparse.loopserve.graph import LoopServeGraphs

    bs = int(fb.batch_size)
    graphs = LoopServeGraphs(runner, list_width=runner.split_width, max_bs=bs, select_rows=bs)
    rpi = fb.req_pool_indices.clone()
    view = SimpleNamespace(batch_size=bs, forward_mode=DecodeMode(), req_pool_indices=rpi, seq_lens_cpu=fb.seq_lens_cpu)
    _set_capture_lora_variant(SELECT)
    try:
        graphs.plan(backend, view, in_capture=True)
    finally:
        _set_capture_lora_variant(None)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for layer in layers:  # warm-up on a side stream, as torch.cuda.graph wants
            runner.decode(backend, o3, q3, layer)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in layers:
            runner.decode(backend, o3, q3, layer)

    def plan():
        if graphs.graph_variant(fb) != "select":
            raise RuntimeError("the bench step is not a re-selecting graph step")
        graphs.plan(backend, view, in_capture=False)

    def step():
        plan()
        graph.replay()

    return plan, step


def measure(case, kind: str, dev: torch.device, iters: int) -> dict:
    runner, backend, fb, q3, o3, layers = build(case, kind, dev)

    def plan():
        runner.begin_batch(backend, fb)

    def step():
        runner.begin_batch(backend, fb)
        for layer in layers:
            runner.decode(backend, o3, q3, layer)

    if kind == "selecting_graph":
        step()  # the first decode step: lines compacted, bases built (as a server's first step does eagerly)
        _sync(dev)
        plan, step = _graph_step(runner, backend, fb, q3, o3, layers)

    for _ in range(3):  # warm-up (Triton compiles, allocator caches)
        step()
    _sync(dev)
    assert runner.dec is not None and any(runner.dec["fire"]) == kind.startswith("selecting")
    assert ("sel_lists" in runner.dec) == (kind in ("selecting", "selecting_unsplit", "selecting_graph"))
    out = {"lse_splits": runner.dec["sel"]["num_splits"] if runner.dec["sel"] is not None else None}
    for name, fn in (("plan", plan), ("step", step)):
        walls, hosts = [], []
        for _ in range(iters):
            _sync(dev)
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            _sync(dev)
            t2 = time.perf_counter()
            hosts.append((t1 - t0) * 1e3)
            walls.append((t2 - t0) * 1e3)
        out[f"{name}_ms"] = statistics.median(walls)
        out[f"{name}_host_ms"] = statistics.median(hosts)
    out["host_ms"] = out.pop("step_host_ms")
    if dev.type == "cuda":  # one profiled step: kernel launches and GPU time
        from torch.profiler import ProfilerActivity, profile

        _sync(dev)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            _sync(dev)
        ev = prof.key_averages()
        out["launches"] = int(sum(e.count for e in ev if e.key in ("cudaLaunchKernel", "cudaLaunchKernelExC",
                                                                     "cuLaunchKernel", "cuLaunchKernelEx")))
        out["gpu_kernel_ms"] = sum(getattr(e, "self_device_time_total", 0.0) for e in ev) / 1e3  # each kernel once
        top = sorted(ev, key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
        out["top_cpu_self_us"] = {e.key: round(e.self_cpu_time_total, 1) for e in top}
        gpu = sorted(ev, key=lambda e: getattr(e, "self_device_time_total", 0.0), reverse=True)[:8]
        out["top_gpu_us"] = {e.key[:60]: round(getattr(e, "self_device_time_total", 0.0), 1) for e in gpu}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="report folder (loopserve_step.json / .md)")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU case (Triton interpreter); no speed claim")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--cases", default=None,
                    help="comma-separated case names to run (default: all of " + ", ".join(c[0] for c in CASES) + ")")
    args = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type != "cuda" and not args.smoke:
        ap.error("no GPU: pass --smoke for the CPU smoke case")
    args.out.mkdir(parents=True, exist_ok=True)
    cases = SMOKE if args.smoke else CASES
    if args.cases and not args.smoke:
        names = args.cases.split(",")
        unknown = sorted(set(names) - {c[0] for c in CASES})
        if unknown:
            ap.error(f"--cases: unknown {unknown}; known: {[c[0] for c in CASES]}")
        cases = [c for c in CASES if c[0] in names]
    rows = []
    for case in cases:
        for kind in KINDS:
            if kind == "selecting_graph" and dev.type != "cuda":
                continue
            t0 = time.time()
            r = measure(case, kind, dev, 2 if args.smoke else args.iters)
            rows.append(dict(case=case[0], layers=case[1], qo_heads=case[2], kv_heads=case[3], head_dim=case[4],
                             batch=case[5], context=case[6], budget=case[7], lines=case[8], kind=kind, **r))
            print(f"[loopserve_step] {case[0]} {kind}: step {r['step_ms']:.2f} ms, host {r['host_ms']:.2f} ms, "
                  f"plan {r['plan_ms']:.2f} ms ({time.time() - t0:.0f}s)", flush=True)
    meta = dict(command="python " + " ".join([sys.argv[0], *(argv or sys.argv[1:])]), device=str(dev),
                gpu=torch.cuda.get_device_name() if dev.type == "cuda" else None, torch=torch.__version__,
                smoke=args.smoke)
    (args.out / "loopserve_step.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    lines = ["# LoopServe decode step, runner only (bench/loopserve_step_bench.py)", "",
             f"- command: `{meta['command']}`", f"- device: {meta['gpu'] or 'cpu (smoke, no claim)'}; torch "
             f"{meta['torch']}", "- step = begin_batch + decode of every layer, synced; host = until the last call "
             "returns; plan = begin_batch alone (selecting_graph: the graph's planning, then its replay)", "",
             "| case | kind | layers | batch | context | budget | LSE spans | step ms | host ms | plan ms | launches "
             "| GPU kernel ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['kind']} | {r['layers']} | {r['batch']} | {r['context']} | {r['budget']} | "
                     f"{r['lse_splits'] or ''} | {r['step_ms']:.2f} | {r['host_ms']:.2f} | {r['plan_ms']:.2f} | "
                     f"{r.get('launches', '')} | {r.get('gpu_kernel_ms', float('nan')):.2f} |")
    by = {(r["case"], r["kind"]): r for r in rows}
    ratios = [(c[0], by[(c[0], "selecting_unsplit")]["step_ms"] / by[(c[0], "selecting")]["step_ms"])
              for c in cases if (c[0], "selecting") in by and (c[0], "selecting_unsplit") in by]
    if ratios:
        lines += ["", "Re-selecting step, unsplit / split LSE pass (same run): " +
                  ", ".join(f"{name} {x:.2f}x" for name, x in ratios)]
    sel = [(c[0], by[(c[0], "selecting_sorted")], by[(c[0], "selecting")], by.get((c[0], "selecting_graph")))
           for c in cases if (c[0], "selecting") in by and (c[0], "selecting_sorted") in by]
    if sel:
        lines += ["", "Re-selecting step, sort-based lists / lists from the bases, eager (same run; step): " +
                  ", ".join(f"{name} {a['step_ms'] / b['step_ms']:.2f}x" for name, a, b, _ in sel)]
        graphed = [(name, b, g) for name, _, b, g in sel if g is not None]
        if graphed:
            lines += ["", "Re-selecting step, eager / replayed from the re-selecting CUDA graph (same run; step): " +
                      ", ".join(f"{name} {b['step_ms'] / g['step_ms']:.2f}x" for name, b, g in graphed)]
    steady = [(c[0], by[(c[0], "steady_sorted")], by[(c[0], "steady")]) for c in cases
              if (c[0], "steady") in by and (c[0], "steady_sorted") in by]
    if steady:
        lines += ["", "Steady step, sort-based lists / lists from the sorted bases (same run; step, plan): " +
                  ", ".join(f"{name} {a['step_ms'] / b['step_ms']:.2f}x, {a['plan_ms'] / b['plan_ms']:.2f}x"
                            for name, a, b in steady)]
    for r in rows:
        if r.get("top_gpu_us"):
            lines += ["", f"GPU time by kernel, {r['case']} {r['kind']} (us, one step): " +
                      "; ".join(f"`{k}` {v}" for k, v in r["top_gpu_us"].items())]
    (args.out / "loopserve_step.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
