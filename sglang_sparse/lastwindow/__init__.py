"""``--sparse lastwindow``: the last-window (SnapKV-like) baseline. Its decode runs on LoopServe's backend and
runner (:mod:`sglang_sparse.loopserve`) with a one-shot top-budget selection after prefill.
"""
