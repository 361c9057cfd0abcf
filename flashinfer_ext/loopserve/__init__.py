"""LoopServe kernels: vertical/slash line estimation (``vs_estimate*``, ``vs_lse_split``, ``vs_common``),
alpha-coverage selection and decode top-B (``vs_select``, ``vs_split_search``), sparse prefill
(``vs_prefill``), decode-list union (``list_union``), the decode wrapper over the step's token lists
(``decode``: :class:`~flashinfer_ext.loopserve.decode.VerticalSlashDecode`, plan() once per step, run() per
layer) and their torch references (``reference``).
"""
