"""Line selection of an engaged prefill chunk under ``prefill: "dense"``, deferred to the end of the forward and
batched over layers.

With the dense prefill the stock attention computes every row, and the lines only feed the decode lists and the
turns after, so nothing inside a layer waits for them. Each layer then only keeps the chunk's sampled query rows
(:func:`record_queries`: one gather); after the forward, :func:`select_all_layers` estimates each layer's line sums
(one :func:`flashinfer_ext.loopserve.vs_estimate.vs_estimate` per layer over that layer's keys, now all in the pool)
and selects the lines of every layer in one :func:`flashinfer_ext.loopserve.vs_select.vs_select` call over the
stacked ``[layers x KV heads, seq_len]`` sums, instead of ~25 small launches per layer. The selection works per
head row, so each layer gets exactly the lines it gets when selected alone (tested).

Memory: the stacked selection's temporaries grow with ``layers x KV heads x seq_len``; layers are taken in groups
of at most :data:`SELECT_BATCH_ENTRIES` line entries (all 30 of SmolLM2 at 32k in one group). No host sync.
"""

from __future__ import annotations

import torch

from flashinfer_ext.loopserve.vs_estimate import stack_line_sums
from flashinfer_ext.loopserve.vs_select import vs_select

SELECT_BATCH_ENTRIES = 1 << 22  # (layers x KV heads x seq_len) entries per stacked selection


def record_queries(row, layer_id: int, q_seg: torch.Tensor, scale: float, num_layers: int) -> None:
    """Keep layer ``layer_id``'s sampled query rows of the chunk (``q_seg [T, Hq, D]``) on ``row.q_obs
    [num_layers, R, Hq, D]`` (allocated at the first layer), and the layer's softmax scale."""
    if row.q_obs is None:
        row.q_obs = q_seg.new_empty((num_layers, row.sample.numel()) + tuple(q_seg.shape[1:]))
    row.q_obs[layer_id] = q_seg[row.sample]
    row.scale = scale


def apply_lines(st, sel, lo: int, hi: int, acc_cols: torch.Tensor) -> None:
    """Set the lines of ``sel`` (a selection over layers ``lo .. hi-1`` x KV heads rows) in the request state's masks
    (``vmask`` / ``smask [L, Hk, prompt_len + 1]``; the last column takes the padding) and add their counts and
    covered bound to its statistics (``acc`` columns ``acc_cols``: verticals, slashes, covered). Shared by the
    per-layer selection of a sparse prefill and the deferred one of a dense prefill."""
    hk, pad = st.vmask.shape[1], st.vmask.shape[2] - 1
    for idx, mask in ((sel.v_idx, st.vmask), (sel.s_idx, st.smask)):
        mask[lo:hi].scatter_(2, torch.where(idx >= 0, idx.long(), pad).view(hi - lo, hk, -1), True)
    st.acc.index_add_(0, acc_cols, torch.cat([torch.stack([sel.v_cnt, sel.s_cnt]).sum(1, dtype=torch.float32),
                                              sel.covered_lb.sum(0, keepdim=True)]))


def select_all_layers(row, estimate, pool, slots: torch.Tensor, acc_cols: torch.Tensor) -> None:
    """Estimate and select the lines of every layer of ``row``'s chunk and apply them (:func:`apply_lines`).
    ``estimate(q_rows, pos, k_buf, slots, seq, scale) -> VSLineSums``; ``pool`` gives each layer's keys
    (``get_key_buffer``)."""
    q_obs = row.q_obs
    n_layers = q_obs.shape[0]
    per = max(1, SELECT_BATCH_ENTRIES // max(1, row.state.vmask.shape[1] * row.seq))
    for lo in range(0, n_layers, per):
        hi = min(n_layers, lo + per)
        sums = stack_line_sums([estimate(q_obs[lid], row.sample_pos, pool.get_key_buffer(lid), slots, row.seq,
                                         row.scale) for lid in range(lo, hi)])
        apply_lines(row.state, vs_select(sums, plan=row.sel_plan), lo, hi, acc_cols)
    row.layers_done = n_layers
    row.q_obs = None
