"""The ``lastwindow`` mode's spec (:class:`sglang_sparse.mode_spec.SparseModeSpec`).

Its decode runs on LoopServe's backend and runner (:mod:`sglang_sparse.loopserve.backend`, which picks the
last-window path from the config's mode) and reports through LoopServe's step rows. No per-request options.
"""

from sglang_sparse.config import LastWindowConfig
from sglang_sparse.loopserve.spec import STEP_REPORT
from sglang_sparse.mode_spec import SparseModeSpec

SPEC = SparseModeSpec(
    "lastwindow", LastWindowConfig, "last-window baseline: dense prefill, decode over a fixed top-budget chosen "
    "from the prompt's last queries (SnapKV-like)", implemented=True, devices=("cpu", "cuda"),
    backend_installer="sglang_sparse.loopserve.backend:install", step_report=STEP_REPORT,
)
