"""SamKV's side forwards (selection rows and recompute rows) at static, padded shapes, replayed as CUDA graphs.

Why: each side forward runs ``R`` rows (~150 selection rows, ~15 % of the kept tokens for recompute) through
every layer with the attention computed in torch. The GPU work is small (the weights are read once), but
each layer is ~30 kernel launches from Python: on the H100 the two side forwards took 25-45 ms per request on
both SmolLM2-135M and a Llama-3.1-8B shape, more than SmolLM2's whole dense prefill of 8k tokens.

Both kinds call :func:`side_rows_forward` with :func:`sglang_sparse.samkv.side.side_forward`'s one
formulation: every row's fresh K/V appended after the ``C`` context rows, a bool mask ``[R, C + R]`` saying which
keys each row sees (the recompute hides a row's reused context entry and shows its fresh one).

Paths (config ``side_graphs``; ``metadata.sparse.side_forward`` says which ran):

* ``off`` - eager at the request's own shapes;
* ``pad`` - :class:`SideGraphs` run eagerly: rows padded to a bucket of ``R`` and the context to a bucket of
  ``C``, static buffers, what a graph replays (CPU tests compare it with ``off``);
* ``auto`` - on CUDA, ``pad`` captured once per bucket into a CUDA graph (shared memory pool) and replayed;
  elsewhere ``off``. A capture that fails logs once and falls back to eager for good.

Buckets: rows up to ``side_graph_max_rows`` (multiples of 64 up to 512, then of 256), context up to
``side_graph_max_context`` (multiples of 256 up to 1024, then of 512); larger requests run eagerly. Padded rows read token 0 at
position 0 and see context row 0 only; padded context columns are masked out and hold finite values (the
buffers start zeroed and only ever receive pool KV), so they add exact zeros.

Memory (allocated at the first samkv request, logged): context K/V ``2 * layers * max_context * kv_heads *
head_dim`` in the model dtype, fresh K/V ``2 * layers * max_rows * ...``, and fp32 queries of the layers the
selection reads ``(layers - q_from) * max_rows * q_heads * head_dim``; for a Llama-3.1-8B shape with the
defaults (512 rows, 4096 context, queries of 20 layers) ~0.75 GB, plus the graphs' shared pool.

Cautions: Llama-style stacks only (as :func:`sglang_sparse.samkv.side.side_forward`); outputs are copied out
of the static buffers, so a later run never overwrites what an earlier caller holds.
"""

from __future__ import annotations

import logging

import torch

from sglang_sparse.samkv.side import side_forward

logger = logging.getLogger(__name__)


def rows_bucket(r: int) -> int:
    """Padded row count: multiples of 64 up to 512, then of 256."""
    step = 64 if r <= 512 else 256
    return max(step, -(-int(r) // step) * step)


def context_bucket(c: int) -> int:
    """Padded context length: multiples of 256 up to 1024, then of 512 (the recompute's fp32 attention grows with
    the padded length: a power-of-two bucket took a 2144-token composite to 4096 on the H100 8B run)."""
    step = 256 if c <= 1024 else 512
    return max(step, -(-int(c) // step) * step)


class SideGraphs:
    """Static buffers, per-bucket masks and (``capture``) CUDA graphs of the padded side forward.

    rt: the scheduler's :class:`~sglang_sparse.samkv.assembly.SamKVRuntime` (model, layers); q_from: first layer
    whose pre-RoPE queries are returned; max_rows / max_context: the largest bucket; capture: record CUDA
    graphs (False: run the padded body eagerly, the ``pad`` path).
    """

    def __init__(self, rt, q_from: int, max_rows: int, max_context: int, capture: bool):
        self.rt = rt
        self.q_from = int(q_from)
        self.max_rows = rows_bucket(max_rows) if max_rows > 0 else 0
        self.max_context = context_bucket(max_context) if max_context > 0 else 0
        self.capture = bool(capture)
        self.broken: str | None = None       # why graphs were given up (eager from then on)
        self.replays = 0
        self.captures = 0
        self._bufs: dict[str, torch.Tensor] | None = None
        self._masks: dict[tuple[int, int], torch.Tensor] = {}
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._pool = None

    def fits(self, rows: int, context: int) -> bool:
        return 0 < rows <= self.max_rows and 0 < context <= self.max_context

    @property
    def path(self) -> str:
        return "graph" if self.capture and self.broken is None else "pad"

    def _alloc(self, device, dtype) -> dict[str, torch.Tensor]:
        if self._bufs is None:
            a = self.rt.model.model.layers[0].self_attn
            layers, rmax, cmax = self.rt.num_layers, self.max_rows, self.max_context
            z = dict(device=device)
            self._bufs = {
                "ids": torch.zeros(rmax, dtype=torch.int64, **z), "pos": torch.zeros(rmax, dtype=torch.int64, **z),
                "ctx_k": torch.zeros(layers, cmax, a.num_kv_heads, a.head_dim, dtype=dtype, **z),
                "ctx_v": torch.zeros(layers, cmax, a.num_kv_heads, a.head_dim, dtype=dtype, **z),
                "k_out": torch.zeros(layers, rmax, a.num_kv_heads, a.head_dim, dtype=dtype, **z),
                "v_out": torch.zeros(layers, rmax, a.num_kv_heads, a.head_dim, dtype=dtype, **z),
                "q_out": torch.zeros(max(0, layers - self.q_from), rmax, a.num_heads, a.head_dim,
                                     dtype=torch.float32, **z)}
            gb = sum(t.numel() * t.element_size() for t in self._bufs.values()) / 2**30
            logger.info("sglang-sparse samkv: side-forward buffers %.3f GiB (rows <= %d, context <= %d, %s)",
                        gb, rmax, cmax, "CUDA graphs" if self.capture else "padded eager")
        return self._bufs

    def _body(self, key: tuple[int, int]) -> None:
        """The padded forward of bucket ``key`` = (rows, context): reads the static inputs, writes q/k/v out."""
        rb, cb = key
        b = self._bufs
        ctx_k = [b["ctx_k"][layer, :cb] for layer in range(self.rt.num_layers)]
        ctx_v = [b["ctx_v"][layer, :cb] for layer in range(self.rt.num_layers)]

        def keep(layer_id, k, v):
            b["k_out"][layer_id, :rb].copy_(k)
            b["v_out"][layer_id, :rb].copy_(v)

        qs = side_forward(self.rt, b["ids"][:rb], b["pos"][:rb], ctx_k, ctx_v, self._masks[key],
                          first_layer=self.q_from, on_layer=keep)
        for i, q in enumerate(qs):
            b["q_out"][i, :rb].copy_(q)

    def _graph(self, key):
        g = self._graphs.get(key)
        if g is not None or not self.capture or self.broken is not None:
            return g
        try:
            torch.cuda.synchronize()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):           # warm-up: lazy initialisations happen outside the capture
                self._body(key)
            torch.cuda.current_stream().wait_stream(side)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self._pool, capture_error_mode="thread_local"):
                self._body(key)
            self._graphs[key] = g
            self.captures += 1
            return g
        except Exception as e:  # noqa: BLE001 - any capture failure: eager from now on, the request still served
            self.broken = f"{type(e).__name__}: {e}"
            logger.warning("sglang-sparse samkv: CUDA-graph capture of the side forward failed (%s); running it "
                           "eagerly from now on", self.broken)
            torch.cuda.synchronize()
            return None

    @torch.no_grad()
    def run(self, ids, pos, ctx_k, ctx_v, mask):
        """Same contract as :func:`side_rows_forward` (the caller checked :meth:`fits`)."""
        r, c = ids.shape[0], ctx_k[0].shape[0]
        key = (rows_bucket(r), context_bucket(c))
        rb, cb = key
        b = self._alloc(ids.device, self.rt.model.model.embed_tokens.weight.dtype)
        b["ids"][:r].copy_(ids)
        b["ids"][r:rb].zero_()
        b["pos"][:r].copy_(pos)
        b["pos"][r:rb].zero_()
        for layer in range(self.rt.num_layers):
            b["ctx_k"][layer, :c].copy_(ctx_k[layer])
            b["ctx_v"][layer, :c].copy_(ctx_v[layer])
        m = self._masks.get(key)
        if m is None:
            m = self._masks[key] = torch.zeros(rb, cb + rb, dtype=torch.bool, device=ids.device)
        m.zero_()
        m[:r, :c].copy_(mask[:, :c])
        m[:r, cb:cb + r].copy_(mask[:, c:])
        m[r:, 0] = True
        g = self._graph(key)
        if g is not None:
            g.replay()
            self.replays += 1
        else:
            self._body(key)
        n_q = b["q_out"].shape[0]
        return ([b["q_out"][i, :r].clone() for i in range(n_q)], b["k_out"][:, :r].clone(), b["v_out"][:, :r].clone())


def side_rows_forward(rt, ids: torch.Tensor, pos: torch.Tensor, ctx_k, ctx_v, mask: torch.Tensor, q_from: int):
    """Rows ``ids`` ``[R]`` at positions ``pos`` ``[R]`` through every layer over the context ``ctx_k[l]`` /
    ``ctx_v[l]`` ``[C, kv_heads, head_dim]`` (post-RoPE keys) followed by every row's own fresh K/V; ``mask``
    bool ``[R, C + R]`` (each row must see at least one key). Returns ``(queries, k, v, path)``: the rows'
    pre-RoPE queries ``[R, q_heads, head_dim]`` fp32 of layers ``q_from ..``, their fresh post-RoPE keys and
    values ``[layers, R, kv_heads, head_dim]`` in the model's dtype, and the path taken (``graph``, ``pad`` or
    ``eager``): the runtime's :class:`SideGraphs` when it has one and the shapes fit, else eager."""
    graphs = getattr(rt, "side_graphs", None)
    if graphs is not None and graphs.q_from <= q_from and graphs.fits(ids.shape[0], ctx_k[0].shape[0]):
        qs, k, v = graphs.run(ids, pos, ctx_k, ctx_v, mask)
        return qs[q_from - graphs.q_from:], k, v, graphs.path
    ks, vs = [], []
    qs = side_forward(rt, ids, pos, ctx_k, ctx_v, mask, first_layer=q_from,
                      on_layer=lambda layer, k, v: (ks.append(k), vs.append(v)))
    return qs, torch.stack(ks), torch.stack(vs), "eager"
