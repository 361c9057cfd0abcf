"""ws_record_tokens (Triton) writes exactly what its torch reference writes: the step of each row into the block
(token // block_size) of every valid listed token (j < lens, token >= 0, block < max_blocks), and nothing else;
the WorkingSetTracker's token path gives the same stamps and sizes through the kernel and through torch
(CPU interpreter here; the same on CUDA under the gpu marker)."""

from __future__ import annotations

import pytest
import torch

from flashinfer_ext.host_tier.ws_record import ws_record_tokens, ws_record_tokens_reference

# (rows, kv heads, width, layers, block size, max blocks): one entry; several kv head counts (GQA 1..8 heads);
# a width over one program (partial last program); page 1 (a block per token); a partial last page (context
# ends inside block max_blocks - 1); tokens past max_blocks (skipped)
SHAPES = [
    (1, 1, 1, 1, 1, 4), (3, 2, 37, 2, 16, 5), (4, 8, 300, 3, 1, 300), (2, 3, 600, 2, 16, 40), (5, 4, 64, 1, 7, 9),
]


def _case(bs, hk, width, layers, block_size, max_blocks, device, seed, padded, with_lens):
    g = torch.Generator().manual_seed(seed)
    cols = max_blocks + 1
    slots = bs + 1
    stamp = torch.full((slots, layers, hk, cols), -7, dtype=torch.int32)
    # token positions up to a little past max_blocks blocks; many repeats of a block (and of a token)
    hi = max_blocks * block_size + block_size // 2 + 1
    lists = torch.randint(0, hi, (bs, hk, width), generator=g, dtype=torch.int32)
    if width > 3:
        lists[:, :, 1] = lists[:, :, 0]  # a duplicate token
    lens = torch.randint(0, width + 1, (bs, hk), generator=g, dtype=torch.int32)
    if padded:  # -1 after lens (and a stray -1 inside)
        pad = torch.arange(width).view(1, 1, width) >= lens.view(bs, hk, 1)
        lists = torch.where(pad, -1, lists)
        if width > 2:
            lists[:, :, width // 2] = -1
    slot = torch.randperm(slots, generator=g)[:bs]
    base = slot.view(bs, 1) * (layers * hk * cols) + torch.arange(hk).view(1, hk) * cols
    row_step = torch.randint(1, 1000, (bs,), generator=g, dtype=torch.int32)
    out = [t.to(device) for t in (stamp, lists, lens if with_lens else None, base.to(torch.int64), row_step)
           if t is not None]
    if not with_lens:
        out.insert(2, None)
    return out


def _check(device, bs, hk, width, layers, block_size, max_blocks):
    for seed, (padded, with_lens) in enumerate([(False, True), (True, True), (True, False)]):
        stamp, lists, lens, base, row_step = _case(bs, hk, width, layers, block_size, max_blocks, device, seed,
                                                   padded, with_lens)
        ref = stamp.clone()
        cols = max_blocks + 1
        for layer in range(layers):
            off = layer * hk * cols
            ws_record_tokens(stamp, lists, lens, base, row_step, off, block_size=block_size, max_blocks=max_blocks,
                             block=64)
            ws_record_tokens_reference(ref, lists, lens, base, row_step, off, block_size=block_size,
                                       max_blocks=max_blocks)
        assert torch.equal(stamp, ref), (padded, with_lens)
        assert bool(stamp[..., max_blocks].eq(-7).all())  # never a column past max_blocks
        # the reference itself: a hand count of the marked units for the first row and head of layer 0
        j = lists[0, 0].long()
        ok = (j >= 0) & (j // block_size < max_blocks)
        if lens is not None:
            ok &= torch.arange(width, device=j.device) < lens[0, 0]
        want = set((j[ok] // block_size).tolist())
        s0 = int(base[0, 0]) // (layers * hk * cols)
        got = set(torch.nonzero(ref[s0, 0, 0] != -7).flatten().tolist())
        assert got == want


@pytest.mark.parametrize("bs,hk,width,layers,block_size,max_blocks", SHAPES)
def test_ws_record_tokens_equals_reference_cpu_interpreter(bs, hk, width, layers, block_size, max_blocks):
    _check("cpu", bs, hk, width, layers, block_size, max_blocks)


@pytest.mark.gpu
@pytest.mark.parametrize("bs,hk,width,layers,block_size,max_blocks", SHAPES)
def test_gpu_ws_record_tokens_equals_reference(bs, hk, width, layers, block_size, max_blocks):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _check("cuda", bs, hk, width, layers, block_size, max_blocks)


def test_ws_record_tokens_reads_a_strided_slice_of_a_wider_buffer():
    """The LoopServe lists are slices of wider step buffers (union_append's ``out[:, :, :w]``, a layer of
    ``lists_all``): only the last dim must be contiguous."""
    g = torch.Generator().manual_seed(3)
    wide = torch.randint(0, 80, (2, 3, 50), generator=g, dtype=torch.int32)
    lens_wide = torch.randint(0, 31, (4, 2, 3), generator=g, dtype=torch.int32)
    lists, lens = wide[:, :, :30], lens_wide[1]
    base = (torch.arange(2).view(2, 1) * 3 * 11 + torch.arange(3).view(1, 3) * 11).to(torch.int64)
    step = torch.tensor([5, 9], dtype=torch.int32)
    a, b = torch.zeros(2, 1, 3, 11, dtype=torch.int32), torch.zeros(2, 1, 3, 11, dtype=torch.int32)
    ws_record_tokens(a, lists, lens, base, step, 0, block_size=8, max_blocks=10, block=16)
    ws_record_tokens_reference(b, lists.contiguous(), lens.contiguous(), base, step, 0, block_size=8, max_blocks=10)
    assert torch.equal(a, b) and bool(a.ne(0).any())


def test_ws_record_tokens_rejects_bad_inputs():
    stamp, lists, lens, base, row_step = _case(2, 2, 8, 1, 4, 4, "cpu", 0, False, True)
    with pytest.raises(ValueError, match="lens"):
        ws_record_tokens(stamp, lists, lens[:1], base, row_step, 0, block_size=4, max_blocks=4)
    with pytest.raises(ValueError, match="int32"):
        ws_record_tokens(stamp, lists.long(), lens, base, row_step, 0, block_size=4, max_blocks=4)
    with pytest.raises(ValueError, match="block_size"):
        ws_record_tokens(stamp, lists, lens, base, row_step, 0, block_size=0, max_blocks=4)


def test_tracker_token_path_with_the_kernel_equals_its_torch_reference():
    """WorkingSetTracker.record_tokens through ws_record_tokens (the LoopServe kernel path) leaves the same stamps
    and sizes as through ws_record_tokens_reference (the CPU reference path), over steps with slot reuse and rows
    without a request; a tracker given neither refuses token records."""
    from radix_sparse.working_set_tracker import WorkingSetTracker

    kw = dict(num_slots=3, num_layers=2, num_kv_heads=2, max_blocks=10, window=3, max_batch_size=5,
              order_buffers=False)
    fused = WorkingSetTracker(**kw, token_record_kernel=ws_record_tokens)
    plain = WorkingSetTracker(**kw, token_record_kernel=ws_record_tokens_reference)
    g = torch.Generator().manual_seed(7)
    batches = [["a", "b", "c"], ["a", "b", "c", "d"], ["b", None, "d"], ["d", "e", "f"], ["e", "f"]]
    for keys in batches:
        w = int(torch.randint(1, 60, (1,), generator=g))
        lists = torch.randint(-1, 45, (len(keys), 2, w), generator=g, dtype=torch.int32)
        lens = torch.randint(0, w + 1, (len(keys), 2), generator=g, dtype=torch.int32)
        for tr in (fused, plain):
            tr.plan_rows(tr.assign(keys), tr.max_blocks)
            tr.begin_step()
            for layer in range(2):
                tr.record_tokens(layer, lists, lens, block_size=4)
        assert torch.equal(fused.stamp_buf, plain.stamp_buf)
        assert fused.sizes(keys) == plain.sizes(keys)
    assert any(s for s in plain.sizes(["e", "f"]))
    with pytest.raises(RuntimeError, match="order_buffers"):  # no block-order path on a token-only tracker
        plain.record(0, torch.zeros(2, 2, 10, dtype=torch.int64), torch.ones(2, 2, dtype=torch.int32))
    bare = WorkingSetTracker(**kw)
    bare.plan_rows(bare.assign(["a"]))
    bare.begin_step()
    with pytest.raises(RuntimeError, match="token_record_kernel"):
        bare.record_tokens(0, torch.zeros(1, 2, 4, dtype=torch.int32), None, block_size=4)
