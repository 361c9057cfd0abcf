"""The ``samkv`` mode's spec (:class:`sglang_sparse.mode_spec.SparseModeSpec`).

SamKV keeps the stock attention backend: it installs through hooks (the ``documents`` field on the OpenAI front
door, :mod:`sglang_sparse.samkv.api`; the composite assembly in the scheduler, :mod:`sglang_sparse.samkv.assembly`)
and reports per request in ``metadata["sparse"]`` and per server under ``/server_info`` ``sparse.samkv``. Its
per-request knob (``variant``) travels in the documents request, not in ``custom_params.sparse``.
"""

from sglang_sparse.config import SamKVConfig
from sglang_sparse.mode_spec import SparseModeSpec

SPEC = SparseModeSpec(
    "samkv", SamKVConfig, "per-document KV reuse with SamKV block selection (documents field)",
    implemented=True, devices=("cpu", "cuda"),
)
