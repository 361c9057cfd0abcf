"""Contract: the psa mode maps its user-facing knobs onto the kernel config one to one, and its
installer turns a stock backend object into the PSA variant in place (idempotently)."""

from __future__ import annotations

from sglang_sparse.config import PsaConfig
from sglang_sparse.psa_backend import install, kernel_config


def test_kernel_config_maps_user_knobs():
    k = kernel_config(PsaConfig.from_dict({"epsilon": 0.9, "micro_batch_blocks": 4, "sink_pages": 2,
                                           "local_pages": 3, "max_blocks": 77}))
    assert (k.epsilon, k.micro_batch_blocks, k.sink_blocks, k.local_blocks, k.max_blocks) == (0.9, 4, 2, 3, 77)


class _StockBackend:
    def __init__(self):
        self.calls = []

    def init_forward_metadata(self, forward_batch):
        self.calls.append("init")

    def forward_decode(self, *a, **k):
        return "dense"


def test_install_swaps_class_in_place_and_keeps_stock_methods():
    b = _StockBackend()
    same = install(b, PsaConfig(), page_size=1)
    assert same is b and type(b).__name__ == "Psa_StockBackend" and isinstance(b, _StockBackend)
    assert b.sparse_installed_mode == "psa" and b._psa_block_size == 16
    assert install(b, PsaConfig(), page_size=1) is b and type(b).__mro__[1] is _StockBackend  # idempotent
    assert install(_StockBackend(), PsaConfig(), page_size=32)._psa_block_size == 32


def test_metrics_counters_register_under_the_sglang_sparse_prefix():
    from prometheus_client import CollectorRegistry, generate_latest

    from sglang_sparse.psa_backend import PsaMetrics

    reg = CollectorRegistry()
    m = PsaMetrics(reg)
    m.blocks_read.inc(5)
    text = generate_latest(reg).decode()
    assert "sglang_sparse:psa_blocks_read_total 5.0" in text
