"""What the samkv front door (:mod:`sglang_sparse.samkv.api`, tokenizer process) hands the scheduler's assembly
(:mod:`sglang_sparse.samkv.assembly`): the ``custom_params`` keys of a documents request and the prefill ids of one
document. Values are flat JSON scalars / lists. Imports nothing from sglang.
"""

from __future__ import annotations

SPANS_KEY = "samkv_spans"          # [start_0, len_0, start_1, len_1, ...] of the documents in input_ids
NS_KEY = "samkv_doc_ns"            # the documents' radix namespace (extra_key of their prefill requests)
FILLER_KEY = "samkv_filler"        # [filler token id, page size]
VARIANT_KEY = "samkv_variant"
PREFIX_KEY = "samkv_prefix_len"    # tokens of the shared template prefix P before the documents (0: none)


def doc_key_ids(ids: tuple[int, ...] | list[int], filler: int, page_size: int) -> list[int]:
    """A document's prefill ids: its ids, then ``filler`` up to a multiple of ``page_size``."""
    pad = (-len(ids)) % max(1, page_size)
    return list(ids) + [filler] * pad
