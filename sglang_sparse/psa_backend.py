"""``--sparse psa``: PSA progressive threshold decode inside SGLang's own attention backend.

The mode keeps the attention backend the server would use anyway (``torch_native`` on
CPU, ``flashinfer`` on the GPU) and mixes :class:`PsaDecodeMixin` into its class once, in
the scheduler process (``runtime_hooks.attention_backend_hook``): prefill/extend and every
other backend method stay stock; ``forward_decode`` attends sparsely for the requests whose
context reached ``min_context`` and densely for the rest.

Path per device:
  * CPU: the fp32 torch reference of :mod:`flashinfer_ext.reference` (metadata from scratch,
    cuboid criticality with the GQA group explicit, stable rank, PSA Alg. 1 stop test).
    Correctness path for tests; no speed claim.
  * CUDA: not wired yet (the mode is refused on CUDA at start-up, see ``modes.py``).

Host work: one ``seq_lens_cpu`` comparison per batch in :meth:`init_forward_metadata`
(plan); nothing per layer on the host beyond the CPU reference itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashinfer_ext.config import PsaDecodeConfig
from sglang_sparse.config import PsaConfig


def kernel_config(cfg: PsaConfig) -> PsaDecodeConfig:
    """Map the user-facing :class:`PsaConfig` onto the kernel's :class:`PsaDecodeConfig`."""
    return PsaDecodeConfig(epsilon=cfg.epsilon, micro_batch_blocks=cfg.micro_batch_blocks,
                           sink_blocks=cfg.sink_pages, local_blocks=cfg.local_pages, max_blocks=cfg.max_blocks)


@dataclass
class PsaStats:
    """Counters since start-up (reported under ``/server_info`` -> internal_states -> sparse)."""

    sparse_decode_steps: int = 0   # decode batches with at least one sparse request
    dense_decode_steps: int = 0    # decode batches entirely below min_context
    blocks_read: int = 0           # sum over layers, sparse requests, KV heads
    blocks_total: int = 0          # what dense attention would have read for the same

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["read_fraction"] = self.blocks_read / self.blocks_total if self.blocks_total else None
        return d


class PsaDecodeMixin:
    """Methods placed in front of a stock backend class; see :func:`install`.

    ``install`` copies these methods into a direct subclass of the stock class (CPython
    refuses ``__class__`` assignment to a class with an extra base), so they reach the
    stock implementation through ``self._psa_base`` rather than ``super()``.
    """

    def _psa_setup(self, config: PsaConfig, page_size: int, metrics: "PsaMetrics | None") -> None:
        self._psa_cfg = config
        self._psa_metrics = metrics
        self._psa_kernel_cfg = kernel_config(config)
        self._psa_block_size = page_size if page_size > 1 else config.block_size
        self._psa_rows: torch.Tensor | None = None  # batch rows decoded sparsely (this batch)
        self.sparse_stats = PsaStats()

    def init_forward_metadata(self, forward_batch):
        self._psa_base.init_forward_metadata(self, forward_batch)
        self._psa_rows = None
        if not forward_batch.forward_mode.is_decode():
            return
        lens = forward_batch.seq_lens_cpu
        rows = torch.nonzero(lens >= self._psa_cfg.min_context).flatten() if lens is not None else None
        if rows is None or rows.numel() == 0:
            self.sparse_stats.dense_decode_steps += 1
            if self._psa_metrics is not None:
                self._psa_metrics.dense_steps.inc()
            return
        self._psa_rows = rows
        self.sparse_stats.sparse_decode_steps += 1
        if self._psa_metrics is not None:
            self._psa_metrics.sparse_steps.inc()

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        # stock path first: writes the new K/V and gives dense outputs for every row
        o = self._psa_base.forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache)
        rows = self._psa_rows
        if rows is None:
            return o
        from flashinfer_ext.reference import psa_decode_reference

        num_qo, d = layer.tp_q_head_num, layer.head_dim
        q3 = q.reshape(-1, num_qo, d)[rows]
        dev = forward_batch.seq_lens.device
        o_sparse, _, nread, _ = psa_decode_reference(
            q3, self.token_to_kv_pool.get_key_buffer(layer.layer_id),
            self.token_to_kv_pool.get_value_buffer(layer.layer_id), self.req_to_token_pool.req_to_token,
            forward_batch.req_pool_indices[rows.to(dev)], forward_batch.seq_lens[rows.to(dev)],
            self._psa_kernel_cfg, block_size=self._psa_block_size, sm_scale=layer.scaling)
        o.view(-1, num_qo, d)[rows] = o_sparse.to(o.dtype)
        lens = forward_batch.seq_lens_cpu[rows]
        n_blocks = (lens + self._psa_block_size - 1) // self._psa_block_size
        read, total = int(nread.sum()), int(n_blocks.sum()) * nread.shape[1]
        self.sparse_stats.blocks_read += read
        self.sparse_stats.blocks_total += total
        if self._psa_metrics is not None:
            self._psa_metrics.blocks_read.inc(read)
            self._psa_metrics.blocks_total.inc(total)
        return o


class PsaMetrics:
    """Prometheus counters of the scheduler process (exported by ``/metrics`` with ``--enable-metrics``)."""

    def __init__(self, registry=None):
        from prometheus_client import REGISTRY, Counter

        reg = REGISTRY if registry is None else registry
        mk = lambda name, doc: Counter(f"sglang_sparse:psa_{name}", doc, registry=reg)  # noqa: E731
        self.sparse_steps = mk("sparse_decode_steps", "decode batches with at least one PSA-sparse request")
        self.dense_steps = mk("dense_decode_steps", "decode batches entirely below min_context (dense)")
        self.blocks_read = mk("blocks_read", "KV blocks read by PSA decode (layers x KV heads x requests)")
        self.blocks_total = mk("blocks_dense", "KV blocks a dense decode would have read for the same")


def install(backend, config: PsaConfig, page_size: int, enable_metrics: bool = False):
    """Turn ``backend`` (a constructed stock backend) into its PSA variant, in place."""
    base = type(backend)
    if getattr(backend, "sparse_installed_mode", None) == "psa":
        return backend
    methods = {k: v for k, v in vars(PsaDecodeMixin).items() if not k.startswith("__")}
    backend.__class__ = type(f"Psa{base.__name__}", (base,), {**methods, "__module__": __name__, "_psa_base": base})
    backend._psa_setup(config, page_size, PsaMetrics() if enable_metrics else None)
    backend.sparse_installed_mode = "psa"
    return backend
