"""Kernel-side PSA decode knobs: one frozen dataclass, validated field by field.

Supports: the knobs :class:`flashinfer_ext.psa_decode.PsaDecodeWrapper` needs
(epsilon, micro-batch size, sink/local blocks, read cap, criticality options).
Cautions: this is the *kernel* config. ``sglang_sparse`` maps its user-facing
``PsaConfig`` onto it; nothing here imports sglang. Validation raises
``ValueError`` naming the field, the bad value and the allowed range.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PsaDecodeConfig"]


def _is_pow2(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


@dataclass(frozen=True)
class PsaDecodeConfig:
    """Knobs of progressive threshold decode (PSA Alg. 1).

    A *block* is one KV page for page size > 1, or ``block_size`` consecutive
    token positions of one request for page size 1.
    """

    epsilon: float = 0.95
    """stop a (request, KV head) once the estimated kept mass P_acc >= epsilon; 1.0 = dense."""
    micro_batch_blocks: int = 8
    """blocks attended between two stop tests (PSA's m)."""
    sink_blocks: int = 1
    """first blocks of every request, always attended."""
    local_blocks: int = 2
    """last blocks of every request (incl. the partial one), always attended."""
    max_blocks: int = 4096
    """upper bound on blocks read per (request, KV head), sink and local blocks excepted."""
    criticality: str = "cuboid"
    """block score: 'cuboid' = sum_d max(q_d*min_d, q_d*max_d) (an upper bound), 'mean' = q . mean."""
    group_reduce: str = "max"
    """how the query heads of one KV head's group combine into one score: 'max' or 'sum'."""

    def __post_init__(self) -> None:
        def bad(name: str, rng: str) -> ValueError:
            return ValueError(f"PsaDecodeConfig.{name}={getattr(self, name)!r} is out of range: expected {rng}")

        if isinstance(self.epsilon, bool) or not isinstance(self.epsilon, (int, float)) \
                or not (0.0 < float(self.epsilon) <= 1.0):
            raise bad("epsilon", "a number in (0, 1]")
        object.__setattr__(self, "epsilon", float(self.epsilon))
        for name, lo, hi in (("micro_batch_blocks", 1, 4096), ("sink_blocks", 0, 1024),
                             ("local_blocks", 0, 1024), ("max_blocks", 1, 1 << 24)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not (lo <= v <= hi):
                raise bad(name, f"an integer in [{lo}, {hi}]")
        if not _is_pow2(self.micro_batch_blocks):
            raise bad("micro_batch_blocks", "a power of two in [1, 4096]")
        if self.criticality not in ("cuboid", "mean"):
            raise bad("criticality", "one of 'cuboid', 'mean'")
        if self.group_reduce not in ("max", "sum"):
            raise bad("group_reduce", "one of 'max', 'sum'")
