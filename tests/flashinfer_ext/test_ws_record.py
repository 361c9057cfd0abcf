"""ws_record (Triton) writes exactly what its torch reference writes: the step of each row into the units its
first nread ranks name, and nothing else (CPU interpreter here; the same on CUDA under the gpu marker)."""

from __future__ import annotations

import pytest
import torch

from flashinfer_ext.host_tier.ws_record import ws_record, ws_record_reference

SHAPES = [  # (bs, kv heads, cols, layers): a partial last block of the grid, GQA-like head counts, one column
    (1, 1, 1, 1), (3, 2, 37, 2), (4, 8, 130, 3), (2, 3, 600, 2),
]


def _case(bs, hk, cols, layers, device, seed):
    g = torch.Generator().manual_seed(seed)
    slots = bs + 1
    cols1 = cols + 1
    stamp = torch.full((slots, layers, hk, cols1), -7, dtype=torch.int32)
    order = torch.stack([torch.stack([torch.randperm(cols, generator=g) for _ in range(hk)]) for _ in range(bs)])
    nread = torch.randint(0, cols + 3, (bs, hk), generator=g, dtype=torch.int32)  # > cols: clipped
    slot = torch.randperm(slots, generator=g)[:bs]
    base = slot.view(bs, 1) * (layers * hk * cols1) + torch.arange(hk).view(1, hk) * cols1
    row_step = torch.randint(1, 1000, (bs,), generator=g, dtype=torch.int32)
    return [t.to(device) for t in (stamp, order, nread, base.to(torch.int64), row_step)]


def _check(device, bs, hk, cols, layers):
    for seed in range(3):
        stamp, order, nread, base, row_step = _case(bs, hk, cols, layers, device, seed)
        ref = stamp.clone()
        for layer in range(layers):
            off = layer * hk * (cols + 1)
            ws_record(stamp, order, nread, base, row_step, off, block=64)
            ws_record_reference(ref, order, nread.clamp(max=cols), base, row_step, off)
        assert torch.equal(stamp, ref)
        assert (stamp != -7).sum() == ref.ne(-7).sum() and (stamp != -7).any() == bool((nread > 0).any())


@pytest.mark.parametrize("bs,hk,cols,layers", SHAPES)
def test_ws_record_equals_reference_cpu_interpreter(bs, hk, cols, layers):
    _check("cpu", bs, hk, cols, layers)


@pytest.mark.gpu
@pytest.mark.parametrize("bs,hk,cols,layers", SHAPES)
def test_gpu_ws_record_equals_reference(bs, hk, cols, layers):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _check("cuda", bs, hk, cols, layers)


def test_ws_record_rejects_mismatched_shapes():
    stamp, order, nread, base, row_step = _case(2, 2, 8, 1, "cpu", 0)
    with pytest.raises(ValueError, match="nread"):
        ws_record(stamp, order, nread[:1], base, row_step, 0)


def test_tracker_with_the_fused_kernel_equals_its_torch_path():
    """WorkingSetTracker.record through ws_record (what the CUDA runner injects) leaves the same stamps and sizes
    as its torch path, over steps with slot reuse."""
    from radix_sparse.working_set_tracker import WorkingSetTracker

    kw = dict(num_slots=3, num_layers=2, num_kv_heads=2, max_blocks=40, window=3, max_batch_size=4)
    fused, plain = WorkingSetTracker(**kw, record_kernel=ws_record), WorkingSetTracker(**kw)
    g = torch.Generator().manual_seed(5)
    batches = [["a", "b", "c"], ["a", "b", "c", "d"], ["b", "d"], ["d", "e", "f"], ["e", "f"]]
    for keys in batches:
        cols = int(torch.randint(1, 41, (1,), generator=g))
        order = torch.stack([torch.stack([torch.randperm(cols, generator=g) for _ in range(2)])
                             for _ in keys])
        nread = torch.randint(0, cols + 1, (len(keys), 2), generator=g, dtype=torch.int32)
        for tr in (fused, plain):
            tr.plan_rows(tr.assign(keys), cols)
            tr.begin_step()
            for layer in range(2):
                tr.record(layer, order, nread)
        # the trash row / column differ: the torch path writes unread ranks there, the kernel skips them
        live = fused.stamp_buf[: kw["num_slots"], ..., : kw["max_blocks"]]
        assert torch.equal(live, plain.stamp_buf[: kw["num_slots"], ..., : kw["max_blocks"]])
        assert fused.sizes(keys) == plain.sizes(keys)
