"""The ``psa`` mode's spec (:class:`sglang_sparse.mode_spec.SparseModeSpec`)."""

from sglang_sparse.config import PsaConfig
from sglang_sparse.mode_spec import RequestOption, SparseModeSpec, StepReport

SPEC = SparseModeSpec(
    "psa", PsaConfig, "progressive threshold sparse decode (PSA)", implemented=True, devices=("cpu", "cuda"),
    backend_installer="sglang_sparse.psa.backend:install",
    request_options=(RequestOption("epsilon", 0.0, 1.0, "min_request_epsilon",
                                   "kept-mass threshold in (0, 1]; 1.0 = dense decode for this request",
                                   default_field="epsilon"),),
    step_report=StepReport("psa_step_rows", "sparse_psa_steps", "sglang_sparse.psa.stats:summarize_steps"),
)
