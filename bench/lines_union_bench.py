"""LoopServe's decode-list kernels by block width: :func:`flashinfer_ext.loopserve.lines_union.lines_union` (every
layer's lists of a step, once per step) and :func:`~flashinfer_ext.loopserve.lines_union.lines_append` (a re-selecting
layer's new top-B, once per layer), timed from CUDA-graph replays at 1 / 8 / 32 rows on the 32k testbed's shapes.

Shapes: SmolLM2 (30 layers, 3 KV heads), a 32768-token context, bases of ``--base`` sorted distinct positions per
(row, layer, KV head) (the lines, sink and top-B of a 32k prompt at alpha 0.99: ~10k), ``--slash`` slash offsets, a
tail of 16 generated tokens, a top-B of 1024 appended; the lists are written into a graph-sized static buffer
(``zero_fill`` off, as a replayed step does). Every block's lists and lengths are checked equal to the first one's
(the kernels' output does not depend on the block). Bytes: the base read and the lists written (int32).

    python bench/lines_union_bench.py --out DIR   # GPU: DIR/lines_union_blocks.{json,md}
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.psa_decode_bench import graph_of  # noqa: E402
from bench.timing import timed  # noqa: E402
from flashinfer_ext.loopserve.lines_union import BLOCK, lines_append, lines_union  # noqa: E402

LAYERS, KV_HEADS, CONTEXT, TAIL, TOPB = 30, 3, 32768, 16, 1024


def inputs(rows: int, base_w: int, slash_w: int, dev, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    since = CONTEXT - TAIL
    base = torch.stack([torch.randperm(since, generator=g)[:base_w].sort().values
                        for _ in range(rows * LAYERS * KV_HEADS)]).view(rows, LAYERS, KV_HEADS, base_w)
    offs = torch.stack([torch.randperm(CONTEXT // 2, generator=g)[:slash_w].sort().values
                        for _ in range(rows * LAYERS * KV_HEADS)]).view(rows, LAYERS, KV_HEADS, slash_w)
    extra = torch.stack([torch.randperm(since, generator=g)[:TOPB] for _ in range(rows * KV_HEADS)])
    i32 = dict(dtype=torch.int32, device=dev)
    return dict(base=base.to(**i32), base_lens=torch.full((rows, LAYERS, KV_HEADS), base_w, **i32),
                s_idx=offs.to(**i32), since=torch.full((rows,), since, **i32), seq=torch.full((rows,), CONTEXT, **i32),
                extra=extra.view(rows, KV_HEADS, TOPB).to(**i32),
                out=torch.zeros(LAYERS, rows, KV_HEADS, CONTEXT + TOPB, **i32),
                lens=torch.zeros(LAYERS, rows, KV_HEADS, **i32), marks=torch.zeros(LAYERS, rows, KV_HEADS, 2, **i32))


def graph_us(fn, reps: int = 20) -> float:
    """Per call (us): the median CUDA-event time of a graph of ``reps`` calls of ``fn`` (:func:`bench.timing.timed`)."""
    g = graph_of(lambda: [fn() for _ in range(reps)])
    return 1e6 * timed(g.replay, iters=30) / reps


def run_case(rows: int, base_w: int, slash_w: int, blocks, dev) -> list[dict]:
    x = inputs(rows, base_w, slash_w, dev)
    args = (x["base"], x["base_lens"], x["s_idx"], x["since"], x["seq"])
    ref = None
    out = []
    for block in blocks:
        def union(block=block):
            lines_union(*args, max_since=TAIL, out=x["out"], lens_out=x["lens"], marks_out=x["marks"], zero_fill=False,
                        block=block)

        def append(block=block):  # one layer's top-B onto the lists of layer 0 (their lengths reset first)
            x["lens"][0].copy_(lens0)
            lines_append(x["out"][0], x["lens"][0], x["marks"][0], x["since"], x["seq"], x["extra"], block=block)

        union()
        torch.cuda.synchronize()
        n = x["lens"].clone()
        lens0 = n[0].clone()
        got = [x["out"][i, j, h, : int(n[i, j, h])].clone() for i in (0, LAYERS - 1) for j in range(rows)
               for h in range(KV_HEADS)]
        append()
        torch.cuda.synchronize()
        got.append(x["out"][0, :, :, : int(x["lens"][0].max())].clone())
        same = ref is None or (all(torch.equal(a, b) for a, b in zip(got, ref)))
        ref = ref or got
        t_union = graph_us(union)
        t_append = graph_us(append)
        nbytes = 4 * (int(x["base_lens"].sum()) + int(n.sum()))
        out.append(dict(rows=rows, base=base_w, slash=slash_w, block=block, union_us=t_union, append_us=t_append,
                        union_tbps=nbytes / t_union / 1e6, same_lists_as_first_block=same))
        print(json.dumps(out[-1]), flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--blocks", default="256,512,1024,2048")
    ap.add_argument("--base", type=int, default=10000, help="base entries per list")
    ap.add_argument("--slash", type=int, default=1500, help="slash offsets per list")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    dev = torch.device("cuda")
    blocks = [int(b) for b in a.blocks.split(",")]
    res = [r for rows in (int(x) for x in a.rows.split(",")) for r in run_case(rows, a.base, a.slash, blocks, dev)]
    import triton

    meta = dict(gpu=torch.cuda.get_device_name(), versions=dict(torch=torch.__version__, triton=triton.__version__),
                command="python bench/lines_union_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                default_block=BLOCK, layers=LAYERS, kv_heads=KV_HEADS, context=CONTEXT, topb=TOPB, tail=TAIL)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "lines_union_blocks.json").write_text(json.dumps(dict(meta=meta, results=res), indent=1))
    lines = ["# LoopServe decode-list kernels by block width", "", f"- GPU: {meta['gpu']}",
             f"- versions: torch {meta['versions']['torch']}, triton {meta['versions']['triton']}",
             f"- command: `{meta['command']}`",
             f"- shapes: {LAYERS} layers x {KV_HEADS} KV heads, context {CONTEXT}, base {a.base} and {a.slash} slash "
             f"offsets per list, tail {TAIL}, top-B {TOPB}; CUDA-graph replays (median of 30 timings of a graph of 20 calls)",
             f"- lines_append default block: {BLOCK}; lines_union default: by program count (`union_block`)", "",
             "| rows | block | lines_union us (all layers) | TB/s | lines_append us (one layer) | same lists |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['rows']} | {r['block']} | {r['union_us']:.1f} | {r['union_tbps']:.2f} | {r['append_us']:.1f} | "
              f"{r['same_lists_as_first_block']} |" for r in res]
    (a.out / "lines_union_blocks.md").write_text("\n".join(lines) + "\n")
    return 0 if all(r["same_lists_as_first_block"] for r in res) else 1


if __name__ == "__main__":
    raise SystemExit(main())
