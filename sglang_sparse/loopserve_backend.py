"""``--sparse loopserve``: LoopServe online vertical/slash prefill + progressive decode in SGLang's own backend.

Like ``psa`` (:mod:`sglang_sparse.psa_backend`), the mode keeps the attention backend the server
would use anyway (``torch_native`` on CPU, ``flashinfer``/``triton`` on the GPU) and turns that
object into a direct subclass carrying the methods of :class:`LoopServeMixin`, once, in the
scheduler process (``runtime_hooks.attention_backend_hook``). Per batch
:meth:`LoopServeRunner.begin_batch` plans (host work); per layer ``forward_extend`` runs the stock
path (K/V written exactly as stock, dense rows computed) and then the sparse prefill of every row
whose context reached ``min_context``; ``forward_decode`` likewise for the requests whose prefill
was sparse (Alg. 3). See :mod:`sglang_sparse.loopserve_runner` for the paths and where host work
goes, :mod:`sglang_sparse.loopserve_radix` for the per-turn lines on radix nodes, and
:mod:`sglang_sparse.loopserve_stats` for the statistics.

The scheduler rows' ``Req`` objects reach the backend through ``forward_batch.sampling_info.sparse_reqs``
(set by ``api_hooks.forward_batch_hook``); statistics leave through ``api_hooks.model_forward_hook``
(SGLang's ``customized_info``) and reach the response as ``metadata["sparse"]`` through
``api_hooks``' response hooks (the ``STEP_SOURCES`` registry there).
"""

from __future__ import annotations

import logging

import torch

from sglang_sparse.config import LoopServeConfig
from sglang_sparse.loopserve_runner import RUNNER_ENV, LoopServeRunner, use_kernels_for
from sglang_sparse.loopserve_stats import LoopServeMetrics, LoopServeStats, account_rows
from sglang_sparse.psa_runner import AttnShape
from sglang_sparse.psa_stats import StepRows

__all__ = ["install", "LoopServeMixin", "RUNNER_ENV"]

logger = logging.getLogger("sglang_sparse")


class LoopServeMixin:
    """Methods placed in front of a stock backend class (reached through ``self._ls_base``)."""

    def init_forward_metadata(self, forward_batch):
        self._ls_base.init_forward_metadata(self, forward_batch)
        self._ls_runner.begin_batch(self, forward_batch)

    def forward_extend(self, q, k, v, layer, forward_batch, *args, **kwargs):
        o = self._ls_base.forward_extend(self, q, k, v, layer, forward_batch, *args, **kwargs)
        runner = self._ls_runner
        if runner.ext_rows:
            hq, d = layer.tp_q_head_num, layer.head_dim
            runner.extend(self, o.view(-1, hq, d), q.reshape(-1, hq, d), layer)
        return o

    def forward_decode(self, q, k, v, layer, forward_batch, *args, **kwargs):
        o = self._ls_base.forward_decode(self, q, k, v, layer, forward_batch, *args, **kwargs)
        runner = self._ls_runner
        if runner.dec is not None:
            hq, d = layer.tp_q_head_num, layer.head_dim
            runner.decode(self, o.view(-1, hq, d), q.reshape(-1, hq, d), layer)
        return o

    def loopserve_step_rows(self) -> StepRows | None:
        """This forward's per-row statistics as SGLang ``customized_info`` (None when nothing ran)."""
        runner = self._ls_runner
        if runner.step_rows is None or runner.bs == 0:
            return None
        runner.finish_extend()
        rows = runner.step_rows[: runner.bs]
        host = rows if rows.device.type == "cpu" else rows.to("cpu", non_blocking=True)
        stats, metrics = self.sparse_stats, self._ls_metrics
        runner.step_rows = None
        return StepRows(host.clone() if host is rows else host, lambda r: account_rows(r, stats, metrics))



def install(backend, config: LoopServeConfig, page_size: int, enable_metrics: bool = False, model_runner=None):
    """Turn ``backend`` (a constructed stock backend) into its LoopServe variant, in place (idempotent)."""
    if getattr(backend, "sparse_installed_mode", None) == "loopserve":
        return backend
    if model_runner is None:
        raise ValueError("sglang-sparse loopserve: install() needs the model_runner")
    from sglang_sparse import loopserve_radix

    device = torch.device(model_runner.device) if isinstance(model_runner.device, str) else model_runner.device
    args = model_runner.server_args
    if device.type == "cuda" and not getattr(args, "disable_cuda_graph", True):
        raise RuntimeError("sglang-sparse loopserve plans on the host per batch: start the server with "
                           "--disable-cuda-graph")
    base = type(backend)
    methods = {k: v for k, v in vars(LoopServeMixin).items() if not k.startswith("__")}
    backend.__class__ = type(f"LoopServe{base.__name__}", (base,), {**methods, "__module__": __name__,
                                                                    "_ls_base": base})
    stats = LoopServeStats()
    metrics = LoopServeMetrics() if enable_metrics else None
    store = loopserve_radix.install_store(config, stats, metrics)
    kernels = use_kernels_for(device)
    backend._ls_cfg = config
    backend._ls_runner = LoopServeRunner(config, AttnShape.of(model_runner), device, use_kernels=kernels,
                                         store=store)
    backend._ls_metrics = metrics
    backend.sparse_stats = stats
    backend.sparse_installed_mode = "loopserve"
    logger.info("sglang-sparse loopserve: %s path (%s), line store %d MiB", "kernel" if kernels else "reference",
                device.type, config.line_store_mb)
    return backend
