"""Host tier of KV blocks (SparseServe §3.2, PSA §3.4): a pinned host block pool and one GPU block
cache shared by all layers with LRU replacement (pure torch, no sglang import).

Vocabulary.
  * **host block**: one KV page (``page_size`` tokens) of one request position range, for *all*
    layers and KV heads: the unit of allocation (``HostBlockPool.alloc`` / ``free``), like a page of
    SGLang's allocator.
  * **unit**: one (layer, host block, KV head) piece of a host block: the keys and values of one KV
    head for ``page_size`` tokens of one layer, ``[2, page_size, head_dim]``. Sparse decode selects
    per (request, KV head, layer), so the unit is what is selected, cached on the GPU and moved.
    ``unit id = (layer * num_blocks + block) * num_kv_heads + head`` (``HostBlockPool.unit_ids``).

Host layout ``host_buf``: ``[num_layers, num_blocks, num_kv_heads, 2 (k, v), page_size, head_dim]``,
contiguous, so every unit is ONE contiguous run of ``unit_bytes = 2 * page_size * head_dim * itemsize``
bytes (8 KiB at page 16, head_dim 128, bf16) and inside it the keys of one head are token-major
(SparseServe's (H, N, D) block layout, Fig. 5). Why this layout: per-KV-head selection then moves
whole contiguous units (one source segment per selected unit, no strided head gather over PCIe), K
and V of a unit travel together (a selected block always needs both), and ``host_units`` is a
plain ``[num_units, unit_elems]`` view, so the fused gather indexes rows. SGLang's device pool is
token-major ``[slots, kv_heads, head_dim]`` (N, H, D); the transpose happens on the GPU when a
page is packed for saving (flashinfer_ext.host_tier.host_transfer), not over PCIe.

GPU cache ``GpuBlockCache``: ONE device tensor ``cache_buf`` ``[capacity, unit_elems]`` (dtype of the
KV) holding units of any layer (PSA's unified pool: layers whose selections are wide take more
slots, narrow ones fewer), with the index maps kept on the host (int64, ``-1`` = none):
``slot_of_unit_host[num_units]`` and ``unit_of_slot_host[capacity]``, inverse of each other on the
used slots; ``last_use_host[capacity]`` = tick of the last step that used the slot (``-1`` = free).
``acquire(units)`` (one step's selection, distinct unit ids) stamps the hits, then takes for the
misses the free slots first and then the least recently used slots not used by this step (ties by
slot index), and returns the (src unit, dst slot) lists the fused gather copies. Dirty slots (KV
written on the GPU and not yet saved to the host) are returned for saving before they are reused.

Definitions the property tests check: a slot is free iff ``unit_of_slot_host[s] == -1`` iff
``last_use_host[s] == -1``; the two maps are inverse; every cached unit belongs to an allocated host
block; ``host_bytes_used == allocated blocks * block_bytes``; ``resident_bytes == used slots *
unit_bytes``; ``loaded_bytes == misses * unit_bytes``; ``hits + misses`` = units acquired.

Cautions: the bookkeeping is host-side (CPU tensors, like SGLang's allocator free lists); only the
gather's ``src``/``dst`` id lists go to the device each step. Not thread-safe. ``acquire`` raises
``CacheFull`` when one step selects more distinct units than the cache holds: admission
(``working_set.admit``) must keep the summed working sets below the capacity. ``pin_memory`` is
used only when CUDA is available (CPU tests use plain memory).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["HostTierConfig", "KVShape", "HostBlockPool", "GpuBlockCache", "CacheFull", "AcquirePlan",
           "HostTierStats"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_int(owner: str, name: str, val, lo: int, hi: int) -> None:
    if isinstance(val, bool) or not isinstance(val, int) or not lo <= val <= hi:
        raise ValueError(f"{owner}.{name}={val!r} is out of range: expected an integer in [{lo}, {hi}]")


def _check_num(owner: str, name: str, val, lo: float, hi: float, lo_open: bool) -> None:
    ok = not isinstance(val, bool) and isinstance(val, (int, float)) and math.isfinite(val) \
        and (lo < val if lo_open else lo <= val) and val <= hi
    if not ok:
        rng = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise ValueError(f"{owner}.{name}={val!r} is out of range: expected a number in {rng}")


@dataclass(frozen=True)
class HostTierConfig:
    """Sizes of the host tier. Exactly one of ``gpu_cache_blocks`` / ``gpu_cache_mb`` is > 0."""

    host_tier_gb: float = 8.0
    """pinned host memory for KV blocks, GiB (number in (0, 4096])."""
    gpu_cache_blocks: int = 0
    """GPU cache slots, each one unit = (layer, block, KV head) (integer in [0, 2**31 - 1]; 0 = use gpu_cache_mb)."""
    gpu_cache_mb: float = 0.0
    """GPU cache size in MiB (number in [0, 2**20]; 0 = use gpu_cache_blocks)."""
    page_size: int = 16
    """tokens per block (power of two in [1, 256]; the KV page size on CUDA)."""
    working_set_window: int = 12
    """decode steps whose selections form a request's working set (integer in [1, 256]; paper w = 12)."""

    def __post_init__(self) -> None:
        own = "HostTierConfig"
        _check_num(own, "host_tier_gb", self.host_tier_gb, 0.0, 4096.0, lo_open=True)
        _check_int(own, "gpu_cache_blocks", self.gpu_cache_blocks, 0, 2**31 - 1)
        _check_num(own, "gpu_cache_mb", self.gpu_cache_mb, 0.0, float(1 << 20), lo_open=False)
        if (self.gpu_cache_blocks > 0) == (self.gpu_cache_mb > 0):
            raise ValueError(f"{own}.gpu_cache_blocks={self.gpu_cache_blocks!r} / gpu_cache_mb="
                             f"{self.gpu_cache_mb!r}: set exactly one of them > 0")
        _check_int(own, "page_size", self.page_size, 1, 256)
        if self.page_size & (self.page_size - 1):
            raise ValueError(f"{own}.page_size={self.page_size!r} is out of range: expected a power "
                             f"of two in [1, 256]")
        _check_int(own, "working_set_window", self.working_set_window, 1, 256)


@dataclass(frozen=True)
class KVShape:
    """Model KV shape the tier stores: ``num_layers`` x ``num_kv_heads`` x ``head_dim`` in ``dtype``."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        _check_int("KVShape", "num_layers", self.num_layers, 1, 4096)
        _check_int("KVShape", "num_kv_heads", self.num_kv_heads, 1, 1024)
        _check_int("KVShape", "head_dim", self.head_dim, 1, 1024)
        if self.dtype not in _DTYPES:
            raise ValueError(f"KVShape.dtype={self.dtype!r} is not supported: expected one of {_DTYPES}")


@dataclass(frozen=True)
class HostTierStats:
    """Snapshot of the tier's memory and traffic counters (bytes are exact)."""

    host_blocks: int
    host_blocks_used: int
    host_bytes_total: int
    host_bytes_used: int
    cache_slots: int
    cache_slots_used: int
    resident_bytes: int
    hits: int
    misses: int
    evictions: int
    loaded_units: int
    loaded_bytes: int
    saved_units: int
    saved_bytes: int

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 0.0

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["hit_rate"] = self.hit_rate
        return d


class CacheFull(RuntimeError):
    """One step selected more distinct units than the GPU cache can hold at once."""


@dataclass(frozen=True)
class AcquirePlan:
    """Result of ``GpuBlockCache.acquire`` for one step.

    ``slots``: int64 ``[n]`` cache slot of each requested unit (same order). ``load_units`` /
    ``load_slots``: int32 ``[m]`` the misses and the slots they go to (the fused gather's
    ``src_block_ids`` / ``dst_slot_ids``). ``save_slots`` / ``save_units``: int32 ``[d]`` dirty
    victims that must be saved to the host *before* the gather overwrites them.
    """

    slots: torch.Tensor
    load_units: torch.Tensor
    load_slots: torch.Tensor
    save_slots: torch.Tensor
    save_units: torch.Tensor

    @property
    def hits(self) -> int:
        return int(self.slots.numel() - self.load_units.numel())


class GpuBlockCache:
    """One cache tensor for the units of every layer, LRU replacement (see module docstring)."""

    def __init__(self, capacity: int, num_units: int, unit_elems: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        _check_int("GpuBlockCache", "capacity", capacity, 1, 2**31 - 1)
        _check_int("GpuBlockCache", "num_units", num_units, 1, 2**62)
        self.capacity, self.num_units, self.unit_elems, self.dtype = capacity, num_units, unit_elems, dtype
        self.unit_bytes = unit_elems * torch.empty((), dtype=dtype).element_size()
        self.cache_buf = torch.empty((capacity, unit_elems), dtype=dtype, device=device)
        self.slot_of_unit_host = torch.full((num_units,), -1, dtype=torch.int64)
        self.unit_of_slot_host = torch.full((capacity,), -1, dtype=torch.int64)
        self.last_use_host = torch.full((capacity,), -1, dtype=torch.int64)
        self.dirty_host = torch.zeros((capacity,), dtype=torch.bool)
        self._tick = 0
        self._hits = self._misses = self._evictions = self._saved = 0

    # ------------------------------------------------------------------ queries
    @property
    def slots_used(self) -> int:
        return int((self.unit_of_slot_host >= 0).sum())

    def lookup(self, units: torch.Tensor) -> torch.Tensor:
        """int64 ``[n]`` slot of each unit, ``-1`` where not cached (no state change)."""
        return self.slot_of_unit_host[self._units(units)]

    def lru_order(self) -> torch.Tensor:
        """Used slots, least recently used first (ties by slot index): the eviction order."""
        used = torch.nonzero(self.unit_of_slot_host >= 0).flatten()
        key = self.last_use_host[used] * self.capacity + used
        return used[torch.argsort(key)]

    def _units(self, units: torch.Tensor) -> torch.Tensor:
        if not isinstance(units, torch.Tensor) or units.dim() != 1 or units.dtype.is_floating_point:
            raise ValueError("units must be a 1-D integer tensor of unit ids")
        u = units.to("cpu", torch.int64)
        if u.numel() and (int(u.min()) < 0 or int(u.max()) >= self.num_units):
            raise ValueError(f"unit id out of range [0, {self.num_units})")
        return u

    # ------------------------------------------------------------------ updates
    def acquire(self, units: torch.Tensor) -> AcquirePlan:
        """Make ``units`` (distinct ids, one step's selection) resident; plan the loads (see class doc).

        Raises ``CacheFull`` (state unchanged) when ``len(units) > capacity``, ``ValueError`` on
        duplicates or out-of-range ids.
        """
        u = self._units(units)
        n = u.numel()
        if n > self.capacity:
            raise CacheFull(f"step selects {n} units, the GPU cache holds {self.capacity}")
        if torch.unique(u).numel() != n:
            raise ValueError("units must be distinct within one acquire")
        self._tick += 1
        tick = self._tick
        slots = self.slot_of_unit_host[u].clone()
        hit = slots >= 0
        self.last_use_host[slots[hit]] = tick
        miss_units = u[~hit]
        m = miss_units.numel()
        empty32 = torch.empty(0, dtype=torch.int32)
        save_slots = save_units = empty32
        if m:
            # free slots carry stamp -1, so one stable order takes free slots first, then LRU
            key = self.last_use_host * self.capacity + torch.arange(self.capacity)
            key[self.last_use_host == tick] = torch.iinfo(torch.int64).max  # used by this step
            # m smallest keys (all distinct): a partial selection when m is small, a full sort otherwise
            victims = torch.topk(key, m, largest=False, sorted=True).indices if 8 * m < self.capacity \
                else torch.argsort(key)[:m]
            old = self.unit_of_slot_host[victims]
            held = old >= 0
            dirty = self.dirty_host[victims] & held
            save_slots = victims[dirty].to(torch.int32)
            save_units = old[dirty].to(torch.int32)
            self._saved += int(dirty.sum())
            self._evictions += int(held.sum())
            self.slot_of_unit_host[old[held]] = -1
            self.unit_of_slot_host[victims] = miss_units
            self.slot_of_unit_host[miss_units] = victims
            self.last_use_host[victims] = tick
            self.dirty_host[victims] = False
            slots[~hit] = victims
        self._hits += n - m
        self._misses += m
        return AcquirePlan(slots, miss_units.to(torch.int32), slots[~hit].to(torch.int32),
                           save_slots, save_units)

    def mark_dirty(self, units: torch.Tensor) -> None:
        """The GPU copy of these cached units was written (new KV): save before eviction."""
        s = self.slot_of_unit_host[self._units(units)]
        if bool((s < 0).any()):
            raise ValueError("mark_dirty of a unit that is not cached")
        self.dirty_host[s] = True

    def mark_clean(self, units: torch.Tensor) -> None:
        """These cached units were saved to the host (no-op for units not cached)."""
        s = self.slot_of_unit_host[self._units(units)]
        self.dirty_host[s[s >= 0]] = False

    def invalidate(self, units: torch.Tensor) -> int:
        """Drop these units from the cache (their host block was freed); returns how many were cached.
        Their content is discarded, dirty or not (the block is dead)."""
        s = self.slot_of_unit_host[self._units(units)]
        s = s[s >= 0]
        self.slot_of_unit_host[self.unit_of_slot_host[s]] = -1
        self.unit_of_slot_host[s] = -1
        self.last_use_host[s] = -1
        self.dirty_host[s] = False
        return int(s.numel())

    def counters(self) -> tuple[int, int, int, int]:
        """(hits, misses, evictions, saved units) since construction."""
        return self._hits, self._misses, self._evictions, self._saved


class HostBlockPool:
    """Pinned host pool of KV blocks + the shared GPU block cache (see module docstring).

    ``host_buf``: ``[num_layers, num_blocks, num_kv_heads, 2, page_size, head_dim]`` (pinned when CUDA
    is available and ``pin`` is not False); ``host_units``: the same memory as ``[num_units,
    unit_elems]``. ``cache``: a ``GpuBlockCache`` on ``device`` (default: CUDA if available, else CPU).
    """

    def __init__(self, config: HostTierConfig, shape: KVShape, device: torch.device | str | None = None,
                 pin: bool | None = None) -> None:
        self.config, self.shape = config, shape
        p, d = config.page_size, shape.head_dim
        self.unit_elems = 2 * p * d
        self.unit_bytes = self.unit_elems * torch.empty((), dtype=shape.dtype).element_size()
        self.block_bytes = shape.num_layers * shape.num_kv_heads * self.unit_bytes
        self.num_blocks = int(config.host_tier_gb * (1 << 30)) // self.block_bytes
        if self.num_blocks < 1:
            raise ValueError(f"HostTierConfig.host_tier_gb={config.host_tier_gb!r} holds no block of "
                             f"{self.block_bytes} bytes ({shape.num_layers} layers x {shape.num_kv_heads} "
                             f"KV heads x page {p} x head_dim {d} x 2)")
        if config.gpu_cache_blocks:
            capacity = config.gpu_cache_blocks
        else:
            capacity = int(config.gpu_cache_mb * (1 << 20)) // self.unit_bytes
            if capacity < 1:
                raise ValueError(f"HostTierConfig.gpu_cache_mb={config.gpu_cache_mb!r} holds no unit of "
                                 f"{self.unit_bytes} bytes")
        self.num_units = shape.num_layers * self.num_blocks * shape.num_kv_heads
        cuda = torch.cuda.is_available()
        pin = cuda if pin is None else (pin and cuda)
        self.pinned = bool(pin)
        self.host_buf = torch.empty((shape.num_layers, self.num_blocks, shape.num_kv_heads, 2, p, d),
                                    dtype=shape.dtype, pin_memory=self.pinned)
        self.host_units = self.host_buf.view(self.num_units, self.unit_elems)
        if device is None:
            device = "cuda" if cuda else "cpu"
        self.cache = GpuBlockCache(capacity, self.num_units, self.unit_elems, shape.dtype, device)
        # free list: a stack of block ids (top = end); ``_used_host`` marks allocated blocks
        self._free_host = torch.arange(self.num_blocks - 1, -1, -1, dtype=torch.int64)
        self._num_free = self.num_blocks
        self._used_host = torch.zeros(self.num_blocks, dtype=torch.bool)

    # ------------------------------------------------------------------ blocks
    @property
    def blocks_free(self) -> int:
        return self._num_free

    @property
    def blocks_used(self) -> int:
        return self.num_blocks - self._num_free

    def is_allocated(self, blocks: torch.Tensor) -> torch.Tensor:
        return self._used_host[blocks.to("cpu", torch.int64)]

    def alloc(self, n: int) -> torch.Tensor | None:
        """``n`` host blocks (int64 ``[n]``), or ``None`` (nothing taken) when fewer are free."""
        _check_int("HostBlockPool.alloc", "n", n, 0, 2**62)
        if n > self._num_free:
            return None
        out = self._free_host[self._num_free - n:self._num_free].flip(0).clone()
        self._num_free -= n
        self._used_host[out] = True
        return out

    def free(self, blocks: torch.Tensor) -> None:
        """Return host blocks (distinct, allocated); their units leave the GPU cache."""
        b = blocks.to("cpu", torch.int64).flatten()
        if b.numel() == 0:
            return
        if int(b.min()) < 0 or int(b.max()) >= self.num_blocks:
            raise ValueError(f"block id out of range [0, {self.num_blocks})")
        if torch.unique(b).numel() != b.numel():
            raise ValueError("free of duplicate block ids")
        if not bool(self._used_host[b].all()):
            raise ValueError("free of a block that is not allocated")
        self.cache.invalidate(self.unit_ids(b))
        self._used_host[b] = False
        self._free_host[self._num_free:self._num_free + b.numel()] = b
        self._num_free += b.numel()

    # ------------------------------------------------------------------ units
    def unit_ids(self, blocks: torch.Tensor, layers: torch.Tensor | None = None,
                 heads: torch.Tensor | None = None) -> torch.Tensor:
        """int64 unit ids of every (layer, block, head) combination, layer-major then block then
        head (``layers``/``heads`` default to all)."""
        s = self.shape
        b = blocks.to("cpu", torch.int64).flatten()
        lay = torch.arange(s.num_layers) if layers is None else layers.to("cpu", torch.int64).flatten()
        hd = torch.arange(s.num_kv_heads) if heads is None else heads.to("cpu", torch.int64).flatten()
        ids = (lay[:, None, None] * self.num_blocks + b[None, :, None]) * s.num_kv_heads + hd[None, None, :]
        return ids.flatten()

    def unit_coords(self, units: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(layer, block, head) int64 of each unit id."""
        u = units.to("cpu", torch.int64)
        h = self.shape.num_kv_heads
        return u // (h * self.num_blocks), (u // h) % self.num_blocks, u % h

    def acquire(self, units: torch.Tensor) -> AcquirePlan:
        """``cache.acquire`` for units of allocated blocks only (``ValueError`` otherwise)."""
        u = units.to("cpu", torch.int64)
        if u.numel() and not bool(self._used_host[self.unit_coords(u)[1]].all()):
            raise ValueError("acquire of a unit whose host block is not allocated")
        return self.cache.acquire(u)

    # ------------------------------------------------------------------ stats
    def stats(self) -> HostTierStats:
        hits, misses, ev, saved = self.cache.counters()
        used_slots = self.cache.slots_used
        return HostTierStats(
            host_blocks=self.num_blocks, host_blocks_used=self.blocks_used,
            host_bytes_total=self.num_blocks * self.block_bytes,
            host_bytes_used=self.blocks_used * self.block_bytes,
            cache_slots=self.cache.capacity, cache_slots_used=used_slots,
            resident_bytes=used_slots * self.unit_bytes, hits=hits, misses=misses, evictions=ev,
            loaded_units=misses, loaded_bytes=misses * self.unit_bytes,
            saved_units=saved, saved_bytes=saved * self.unit_bytes)
