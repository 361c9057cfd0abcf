"""The ``loopserve`` mode's spec (:class:`sglang_sparse.mode_spec.SparseModeSpec`)."""

from sglang_sparse.config import LoopServeConfig
from sglang_sparse.mode_spec import RequestOption, SparseModeSpec, StepReport

# lastwindow's decode runs on the same backend and reports through the same rows (sglang_sparse.lastwindow.spec)
STEP_REPORT = StepReport("loopserve_step_rows", "sparse_loopserve_steps",
                         "sglang_sparse.loopserve.stats:summarize_steps")

SPEC = SparseModeSpec(
    "loopserve", LoopServeConfig, "online vertical/slash prefill + progressive decode (LoopServe)",
    implemented=True, devices=("cpu", "cuda"), backend_installer="sglang_sparse.loopserve.backend:install",
    request_options=(
        RequestOption("alpha", 0.0, 1.0, "min_request_alpha",
                      "covered fraction of the sampled attention mass in (0, 1]; 1.0 = dense for this request",
                      default_field="alpha"),
        RequestOption("budget", 0, 1 << 24, doc="top-B tokens per KV head in decode, an integer >= 1",
                      ceil_field="max_request_budget", integer=True, default_field="budget"),
    ),
    step_report=STEP_REPORT,
)
