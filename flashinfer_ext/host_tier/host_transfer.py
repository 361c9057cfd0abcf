"""Host <-> GPU transfer of KV units for the host tier (SparseServe §3.2: FlashH2D and FlashD2H).

Rows ("units") are the per-(layer, block, KV head) pieces of ``radix_sparse.host_pool``: a host
tensor ``[num_units, unit_elems]`` (``HostBlockPool.host_units``) and a cache tensor ``[capacity,
unit_elems]`` (``GpuBlockCache.cache_buf``), same dtype, rows contiguous.

Supports:
  * ``HostGather`` (FlashH2D, GPU-direct loading): ``run(src_block_ids, dst_slot_ids)`` copies host
    rows ``src_block_ids[i]`` to cache rows ``dst_slot_ids[i]`` (int32 ``[n]`` on the cache's device;
    entries ``< 0`` are padding and skipped, so a caller may pass fixed-size lists) in ONE Triton
    launch that reads pinned host memory directly through unified virtual addressing (UVA), grid
    ``(n, chunks per row)``. Rows are moved as 32-bit words, so the copy is bit-exact for every dtype
    (NaN payloads included). The launch runs on the gather's own CUDA stream after the current
    stream's work (``wait()`` makes the consumer stream wait for it); no host sync, no allocation.
  * ``HostSave`` (FlashD2H, CPU-assisted saving): ``save(rows, dst_units)`` makes ONE contiguous
    device->host copy of ``rows`` ``[n, unit_elems]`` into a pinned staging buffer on its own stream,
    then a small thread pool scatters the staged rows into host rows ``dst_units`` (CPU int64
    ``[n]``) once the copy event completes; returns a ``Future``. ``save_slots`` first packs cache
    rows into a contiguous device buffer (``index_select`` on the save stream).
  * ``HostTierIO``: one step of a ``GpuBlockCache.acquire`` plan: dirty victims saved (packed on the
    save stream), then the misses gathered on the gather stream after that pack (a slot is never
    overwritten before its old content is read); ids go to the device through one pinned buffer.
  * ``gather_units_reference`` / ``save_units_reference``: pure-torch row-copy references (bit-exact).

Path selection (``HostGather.path``, decided once in ``__init__``, reported by the benchmark):
  ``triton``            source and destination on the same device (the CPU interpreter, or a
                        device-resident source);
  ``triton_uva``        pinned CPU source passed to Triton as is: Triton's launcher maps every
                        pointer argument with ``cuPointerGetAttribute(DEVICE_POINTER)``, which
                        succeeds for pinned (``cudaHostAlloc``) memory (Triton PR #1197);
  ``triton_uva_ptr``    if that launch is refused: an object exposing ``data_ptr()`` (the device
                        pointer of the pinned buffer: ``cudaHostGetDevicePointer`` when torch exposes
                        it, else the host pointer, identical under UVA) and ``dtype``;
  ``torch_staging``     fallback when both are refused or the source is not pinned: ids copied to
                        the host (one sync), ``index_select`` on the host into a pinned staging
                        buffer, one H2D copy, ``index_copy_`` on the device. Correct, not fast.
  Each UVA path is probed at construction by gathering one row and comparing it with a plain copy.

Cautions: the UVA paths are verified on the GPU only by the ``gpu`` tests; PCIe reads from a kernel
need enough bytes in flight (one program per row chunk of <= 8 KiB). Pageable (non-pinned) host
memory is never read by a kernel. ``HostSave`` keeps one save in flight (a new save first waits for
the previous scatter); rows given to ``save`` must not be overwritten before the copy event (the save
stream waits for the current stream, the caller must not reuse ``rows`` before ``copy_done``).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch
import triton
import triton.language as tl

__all__ = ["HostGather", "HostSave", "HostTierIO", "gather_units_reference", "save_units_reference", "word_view",
           "GATHER_PATHS"]

GATHER_PATHS = ("triton", "triton_uva", "triton_uva_ptr", "torch_staging")
_MAX_CHUNK_WORDS = 2048  # 8 KiB of int32 per program


@triton.jit
def _gather_rows_kernel(src_ptr, dst_ptr, src_ids_ptr, dst_ids_ptr,
                        ROW: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    c = tl.program_id(1)
    s = tl.load(src_ids_ptr + i).to(tl.int64)
    d = tl.load(dst_ids_ptr + i).to(tl.int64)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    mask = (offs < ROW) & (s >= 0) & (d >= 0)
    x = tl.load(src_ptr + s * ROW + offs, mask=mask)
    tl.store(dst_ptr + d * ROW + offs, x, mask=mask)


def word_view(t: torch.Tensor) -> torch.Tensor:
    """``[rows, row_elems]`` viewed as int32 words (int16 when the row bytes are not a multiple of 4)."""
    if t.dim() != 2 or t.stride(1) != 1 or t.stride(0) != t.shape[1]:
        raise ValueError(f"expected a contiguous [rows, row_elems] tensor, got shape {tuple(t.shape)} "
                         f"strides {t.stride()}")
    row_bytes = t.shape[1] * t.element_size()
    return t.view(torch.int32) if row_bytes % 4 == 0 else t.view(torch.int16)


def gather_units_reference(src: torch.Tensor, src_ids: torch.Tensor, dst: torch.Tensor,
                           dst_ids: torch.Tensor) -> None:
    """``dst[dst_ids[i]] = src[src_ids[i]]`` for every ``i`` with both ids >= 0 (row copy loop)."""
    for s, d in zip(src_ids.tolist(), dst_ids.tolist()):
        if s >= 0 and d >= 0:
            dst[d].copy_(src[s])


def save_units_reference(rows: torch.Tensor, dst: torch.Tensor, dst_units: torch.Tensor) -> None:
    """``dst[dst_units[i]] = rows[i]`` (row copy loop)."""
    for i, u in enumerate(dst_units.tolist()):
        dst[u].copy_(rows[i])


class _DevicePtr:
    """A pinned host tensor presented to Triton by its device pointer (``data_ptr()`` + ``dtype``)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.dtype = t.dtype
        self._ptr = t.data_ptr()
        get = getattr(torch.cuda.cudart(), "cudaHostGetDevicePointer", None)
        if get is not None:
            try:
                self._ptr = int(get(t.data_ptr(), 0))
            except Exception:  # binding without that signature: the host pointer is the device pointer under UVA
                pass

    def data_ptr(self) -> int:
        return self._ptr


class HostGather:
    """Fused gather of host rows into cache rows (see module docstring).

    ``src``: ``[num_units, unit_elems]`` host rows (pinned for the UVA paths) or rows on ``dst``'s
    device; ``dst``: ``[capacity, unit_elems]`` same dtype. ``max_rows``: the longest id list
    (``torch_staging`` preallocates its buffers for it). ``path``: ``"auto"`` or one of
    ``GATHER_PATHS`` (forcing a UVA path that fails raises). ``chunk_words`` (power of two in
    [64, 16384]) 32-bit words per program and ``num_warps`` (1, 2, 4, 8 or 16): launch shape knobs
    (the benchmark sweeps them; defaults 2048 words = 8 KiB and 4 warps).
    """

    def __init__(self, src: torch.Tensor, dst: torch.Tensor, max_rows: int, path: str = "auto",
                 chunk_words: int = _MAX_CHUNK_WORDS, num_warps: int = 4) -> None:
        if src.device != dst.device and not (src.device.type == "cpu" and dst.device.type in ("cuda", "cpu")):
            raise ValueError(f"src on {src.device}, dst on {dst.device}: supported are one device, or a "
                             f"CPU (pinned) source and a CUDA destination")
        if src.dtype != dst.dtype or src.dim() != 2 or dst.dim() != 2 or src.shape[1] != dst.shape[1]:
            raise ValueError(f"src {src.dtype} {tuple(src.shape)} and dst {dst.dtype} {tuple(dst.shape)} must "
                             f"be [rows, unit_elems] of one dtype and row size")
        if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1:
            raise ValueError(f"max_rows={max_rows!r} is out of range: expected an integer >= 1")
        if isinstance(chunk_words, bool) or not isinstance(chunk_words, int) or not 64 <= chunk_words <= 16384 \
                or chunk_words & (chunk_words - 1):
            raise ValueError(f"chunk_words={chunk_words!r} is out of range: expected a power of two in [64, 16384]")
        if num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps={num_warps!r} is out of range: expected 1, 2, 4, 8 or 16")
        self.num_warps = num_warps
        if path != "auto" and path not in GATHER_PATHS:
            raise ValueError(f"path={path!r}: expected 'auto' or one of {GATHER_PATHS}")
        self.src, self.dst, self.max_rows = src, dst, max_rows
        self._src_words, self._dst_words = word_view(src), word_view(dst)
        row = self._dst_words.shape[1]
        self._row = row
        self._block = min(triton.next_power_of_2(row), chunk_words)
        self._chunks = triton.cdiv(row, self._block)
        cuda_dst = dst.is_cuda
        self.stream = torch.cuda.Stream(device=dst.device) if cuda_dst else None
        self.event = torch.cuda.Event() if cuda_dst else None
        self.probe_errors: list[str] = []
        self._staging_host = self._staging_buf = None
        if path == "auto":
            path = self._choose()
        elif path in ("triton_uva", "triton_uva_ptr"):
            err = self._probe(path)
            if err:
                raise RuntimeError(f"HostGather path {path!r} failed its probe: {err}")
        elif path == "triton" and src.device != dst.device:
            raise ValueError("path 'triton' needs src and dst on one device (use 'auto' for a host source)")
        elif path == "torch_staging" and src.device.type != "cpu":
            raise ValueError("path 'torch_staging' needs a CPU source")
        self.path = path
        if path == "torch_staging":
            self._staging_host = torch.empty((max_rows, src.shape[1]), dtype=src.dtype,
                                             pin_memory=cuda_dst and torch.cuda.is_available())
            self._staging_buf = torch.empty((max_rows, src.shape[1]), dtype=src.dtype, device=dst.device)
        self._src_arg = _DevicePtr(self._src_words) if path == "triton_uva_ptr" else self._src_words

    # ------------------------------------------------------------------ path choice
    def _choose(self) -> str:
        src, dst = self.src, self.dst
        if src.device == dst.device:
            return "triton"
        if not (dst.is_cuda and src.device.type == "cpu"):
            return "torch_staging"
        if not src.is_pinned():
            self.probe_errors.append("source is not pinned: a kernel may not read pageable memory")
            return "torch_staging"
        for p in ("triton_uva", "triton_uva_ptr"):
            err = self._probe(p)
            if not err:
                return p
            self.probe_errors.append(f"{p}: {err}")
        return "torch_staging"

    def _probe(self, path: str) -> str:
        """Gather row 0 of the source into a scratch row through ``path``; '' when equal to a plain copy."""
        if not (self.dst.is_cuda and self.src.device.type == "cpu" and self.src.is_pinned()):
            return "needs a pinned CPU source and a CUDA destination"
        try:
            scratch = torch.zeros((1, self._row), dtype=self._dst_words.dtype, device=self.dst.device)
            ids = torch.zeros(1, dtype=torch.int32, device=self.dst.device)
            arg = _DevicePtr(self._src_words) if path == "triton_uva_ptr" else self._src_words
            self._launch(arg, scratch, ids, ids)
            torch.cuda.synchronize(self.dst.device)
            want = self._src_words[:1].to(self.dst.device)
            if not torch.equal(scratch, want):
                return "probe row differs from a plain copy"
        except Exception as e:  # noqa: BLE001 - any refusal selects the next path
            return f"{type(e).__name__}: {e}"
        return ""

    def _launch(self, src_arg, dst_words, src_ids, dst_ids) -> None:
        n = src_ids.shape[0]
        if n == 0:
            return
        _gather_rows_kernel[(n, self._chunks)](src_arg, dst_words, src_ids, dst_ids,
                                               ROW=self._row, BLOCK=self._block, num_warps=self.num_warps)

    # ------------------------------------------------------------------ run
    def run(self, src_block_ids: torch.Tensor, dst_slot_ids: torch.Tensor) -> None:
        """Gather ``src[src_block_ids[i]]`` into ``dst[dst_slot_ids[i]]`` (int32 ``[n]``, n <= max_rows,
        on ``dst``'s device; ``< 0`` = skip). Asynchronous on CUDA: call ``wait()`` before reading."""
        if src_block_ids.shape != dst_slot_ids.shape or src_block_ids.dim() != 1:
            raise ValueError("src_block_ids and dst_slot_ids must be 1-D of one length")
        if src_block_ids.shape[0] > self.max_rows:
            raise ValueError(f"{src_block_ids.shape[0]} ids > max_rows={self.max_rows}")
        if self.path == "torch_staging":
            self._run_staging(src_block_ids, dst_slot_ids)
            return
        if self.stream is None:
            self._launch(self._src_arg, self._dst_words, src_block_ids, dst_slot_ids)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.dst.device))
        with torch.cuda.stream(self.stream):
            self._launch(self._src_arg, self._dst_words, src_block_ids, dst_slot_ids)
            self.event.record(self.stream)
        src_block_ids.record_stream(self.stream)
        dst_slot_ids.record_stream(self.stream)

    def _run_staging(self, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
        s, d = src_ids.to("cpu", torch.int64), dst_ids.to("cpu", torch.int64)  # host sync
        keep = (s >= 0) & (d >= 0)
        s, d = s[keep], d[keep]
        n = s.numel()
        if self.event is not None:
            self.event.synchronize()  # the previous H2D from the staging buffer has finished
        torch.index_select(self.src, 0, s, out=self._staging_host[:n])
        self._staging_buf[:n].copy_(self._staging_host[:n], non_blocking=True)
        self.dst.index_copy_(0, d.to(self.dst.device), self._staging_buf[:n])
        if self.event is not None:
            self.event.record(torch.cuda.current_stream(self.dst.device))

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make ``stream`` (default: the current stream) wait for the last ``run`` (no host sync)."""
        if self.event is not None:
            (stream or torch.cuda.current_stream(self.dst.device)).wait_event(self.event)


class HostSave:
    """CPU-assisted saving of device rows into host rows (see module docstring).

    ``host``: ``[num_units, unit_elems]`` host rows (``HostBlockPool.host_units``); ``max_rows``:
    staging capacity; ``device``: where the rows to save live (CUDA, or CPU for tests);
    ``num_threads``: scatter threads.
    """

    def __init__(self, host: torch.Tensor, max_rows: int, device: torch.device | str = "cpu",
                 num_threads: int = 4) -> None:
        if host.dim() != 2 or host.device.type != "cpu":
            raise ValueError("host must be a CPU [num_units, unit_elems] tensor")
        for name, val in (("max_rows", max_rows), ("num_threads", num_threads)):
            if isinstance(val, bool) or not isinstance(val, int) or not 1 <= val <= (1 << 24):
                raise ValueError(f"{name}={val!r} is out of range: expected an integer in [1, {1 << 24}]")
        self.host, self.max_rows, self.num_threads = host, max_rows, num_threads
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self._staging_host = torch.empty((max_rows, host.shape[1]), dtype=host.dtype, pin_memory=cuda)
        self._pack_buf = torch.empty((max_rows, host.shape[1]), dtype=host.dtype, device=self.device)
        self.stream = torch.cuda.Stream(device=self.device) if cuda else None
        self.copy_done = torch.cuda.Event() if cuda else None
        self.packed = torch.cuda.Event() if cuda else None  # save_slots has read the cache rows
        # one coordinator thread per save (waits for the copy, splits the scatter) and the scatter workers
        self._coord = ThreadPoolExecutor(max_workers=1, thread_name_prefix="host_save")
        self._workers = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="host_scatter")
        self._pending: Future | None = None

    def close(self) -> None:
        self.wait()
        self._coord.shutdown(wait=True)
        self._workers.shutdown(wait=True)

    def wait(self) -> None:
        """Block until the last save's scatter finished (re-raises its error)."""
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    def save_slots(self, cache: torch.Tensor, slots: torch.Tensor, dst_units: torch.Tensor) -> Future:
        """Save ``cache[slots[i]]`` (device rows; ``slots`` int32/int64 on ``cache``'s device) to host
        rows ``dst_units[i]``: pack on the device (event ``packed`` after it), then :meth:`save`."""
        n = slots.shape[0]
        self._check(n, dst_units)
        self.wait()  # the pack buffer may still be the source of the previous copy
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                torch.index_select(cache, 0, slots, out=self._pack_buf[:n])
                self.packed.record(self.stream)
            slots.record_stream(self.stream)
        else:
            torch.index_select(cache, 0, slots, out=self._pack_buf[:n])
        return self.save(self._pack_buf[:n], dst_units)

    def save(self, rows: torch.Tensor, dst_units: torch.Tensor) -> Future:
        """One contiguous D2H copy of ``rows`` ``[n, unit_elems]`` (device) into the staging buffer on
        the save stream, then the thread pool scatters into ``host[dst_units]`` (CPU int ``[n]``)."""
        n = rows.shape[0]
        self._check(n, dst_units)
        if rows.shape[1:] != self.host.shape[1:] or rows.dtype != self.host.dtype:
            raise ValueError(f"rows {rows.dtype} {tuple(rows.shape)} do not match host rows {self.host.dtype} "
                             f"{tuple(self.host.shape[1:])}")
        self.wait()
        staged = self._staging_host[:n]
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                staged.copy_(rows, non_blocking=True)
                self.copy_done.record(self.stream)
            rows.record_stream(self.stream)
        else:
            staged.copy_(rows)
        ids = dst_units.to("cpu", torch.int64)
        self._pending = self._coord.submit(self._scatter, staged, ids)
        return self._pending

    def _check(self, n: int, dst_units: torch.Tensor) -> None:
        if n > self.max_rows:
            raise ValueError(f"{n} rows > max_rows={self.max_rows}")
        if dst_units.dim() != 1 or dst_units.shape[0] != n or dst_units.device.type != "cpu":
            raise ValueError(f"dst_units must be a CPU int tensor [{n}]")

    def _scatter(self, staged: torch.Tensor, ids: torch.Tensor) -> int:
        if self.copy_done is not None:
            self.copy_done.synchronize()
        n = ids.numel()
        step = max(1, -(-n // self.num_threads))
        parts = [(a, min(n, a + step)) for a in range(0, n, step)]
        if len(parts) <= 1:
            self.host.index_copy_(0, ids, staged)
            return n
        futs = [self._workers.submit(self.host.index_copy_, 0, ids[a:b], staged[a:b]) for a, b in parts]
        for f in futs:
            f.result()
        return n


class HostTierIO:
    """One step of host-tier traffic for a ``GpuBlockCache.acquire`` plan: save the dirty victims,
    then gather the misses into their slots (the gather waits for the victims' pack, so a slot is
    never overwritten before its old content is read).

    ``host``: host rows ``[num_units, unit_elems]``; ``cache``: cache rows ``[capacity, unit_elems]``;
    ``max_rows``: most loads (and saves) per step. The plan's CPU int32 id lists go to the device
    through one preallocated pinned buffer ``_ids_host`` -> ``_ids_buf`` (one copy per step).
    ``run`` first waits (host) for the previous step's scatter, so every gather reads current host
    rows; then everything is asynchronous (``wait()`` before reading the cache).
    """

    def __init__(self, host: torch.Tensor, cache: torch.Tensor, max_rows: int, num_threads: int = 4,
                 path: str = "auto") -> None:
        self.host, self.cache = host, cache
        self.gather = HostGather(host, cache, max_rows, path=path)
        self.saver = HostSave(host, max_rows, device=cache.device, num_threads=num_threads)
        cuda = cache.is_cuda
        self._ids_host = torch.empty(3 * max_rows, dtype=torch.int32, pin_memory=cuda)
        self._ids_buf = torch.empty(3 * max_rows, dtype=torch.int32, device=cache.device)
        self._ids_done = torch.cuda.Event() if cuda else None

    def run(self, load_units: torch.Tensor, load_slots: torch.Tensor, save_slots: torch.Tensor,
            save_units: torch.Tensor) -> None:
        """``AcquirePlan`` lists (CPU int32): gather ``host[load_units]`` -> ``cache[load_slots]``
        after saving ``cache[save_slots]`` -> ``host[save_units]``."""
        m, d = load_units.numel(), save_slots.numel()
        self.saver.wait()
        if self._ids_done is not None:
            self._ids_done.synchronize()  # the previous step's id copy has left the pinned buffer
        ids = self._ids_host
        ids[:m] = load_units
        ids[m:2 * m] = load_slots
        ids[2 * m:2 * m + d] = save_slots
        k = 2 * m + d
        self._ids_buf[:k].copy_(ids[:k], non_blocking=True)
        if self._ids_done is not None:
            self._ids_done.record(torch.cuda.current_stream(self.cache.device))
        if d:
            self.saver.save_slots(self.cache, self._ids_buf[2 * m:k], save_units.to(torch.int64))
            if self.saver.packed is not None:  # fused paths run on the gather stream, staging on the current one
                self.gather.stream.wait_event(self.saver.packed)
                torch.cuda.current_stream(self.cache.device).wait_event(self.saver.packed)
        self.gather.run(self._ids_buf[:m], self._ids_buf[m:2 * m])

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make ``stream`` wait for the last gather (no host sync)."""
        self.gather.wait(stream)

    def flush(self) -> None:
        """Block until the last save's scatter has landed in ``host``."""
        self.saver.wait()

    def close(self) -> None:
        self.saver.close()
