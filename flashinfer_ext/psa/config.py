"""Kernel-side PSA decode knobs: one frozen dataclass, validated field by field.

Supports: the knobs :class:`flashinfer_ext.psa.decode.PsaDecodeWrapper` needs
(epsilon, micro-batch size, sink/local blocks, read cap, criticality options, the
kept-mass estimator of the stop test and the chunk schedule that fixes where the stop
test is applied: :meth:`PsaDecodeConfig.ranked_chunk_ends`).
Cautions: this is the *kernel* config. ``sglang_sparse`` maps its user-facing
``PsaConfig`` onto it; nothing here imports sglang. Validation raises
``ValueError`` naming the field, the bad value and the allowed range.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PsaDecodeConfig", "ESTIMATORS"]

ESTIMATORS = ("paper", "bound", "calibrated", "mean", "sketch")


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
    """block score: 'cuboid' = sum_d max(q_d*min_d, q_d*max_d) (an upper bound), 'mean' = q . mean,
    'sketch' = the group max of the block's approximate mass share from an int4 copy of every key
    (:mod:`flashinfer_ext.psa.key_sketch`; the blocks are ranked by it whatever ``rank_by`` says)."""
    group_reduce: str = "max"
    """how the query heads of one KV head's group combine into one score: 'max' or 'sum'."""
    rank_by: str = "mean"
    """rank order of the blocks: 'criticality' = by the criticality score above; 'mean' = by the group
    max of q . mean key (the estimator keeps using the criticality scores of the blocks in that order).
    Measured on real testbed attention (bench/results/psa_root_cause.md): post-RoPE keys rotate inside
    a block, so the cuboid bound is ~30 nats above the block's true max logit and ranks a retrieval
    head's needle block 86th-144th of 312 where q . mean ranks it 0th-3rd."""
    estimator: str = "calibrated"
    """remaining-mass estimate R of the stop test P = AS_acc / (AS_acc + R) >= epsilon:
    'paper' = AS_min * N_left (PSA Alg. 1; not conservative on real attention),
    'bound' = sum over unread blocks of block_size * 2^(scale * cuboid score) (a true upper
    bound: kept mass >= epsilon guaranteed, but the cuboid bound is loose, so it reads nearly
    everything), 'calibrated' = that bound times 2^min(0, delta + calib_slack), delta = the
    largest log2(true block mass / block bound) seen among the ranked blocks read so far
    (per query head). 'bound' and 'calibrated' need criticality 'cuboid' and group_reduce 'max'.
    'mean' = sum over unread blocks of block_size * 2^(scale * q . mean key) (the group max; an estimate,
    below the block's true mass by its within-block spread) times 2^(gamma + calib_slack), gamma = the
    largest log2(true block mass / that estimate) among the ranked blocks read so far (calib_slack alone while
    none); needs criticality 'mean' and group_reduce 'max'. Not a bound: a block whose mean key misses q but
    one of whose keys matches it is under-estimated unless read blocks showed such spread.
    'sketch' = per query head g, 2^(T_g + calib_slack) times the sum over unread blocks of their shares (T_g = the
    head's total approximate mass from the int4 key sketch, shares as criticality 'sketch'); needs criticality
    'sketch'. An estimate from every key, not a bound."""
    schedule: str = "progressive"
    """how the stop point is found: 'progressive' = PSA Alg. 1, the stop test after every chunk of the ranked list
    on the true mass read so far (attention waves with merges between them); 'select' (estimator 'sketch' only) =
    the sketch's own prediction, the fewest top blocks whose approximate unread share ``U`` keeps
    ``1 - 2^calib_slack U >= epsilon``, selected in one pass (:mod:`flashinfer_ext.psa.sketch_select`) and read
    in one split pass: no sort, no waves, no true mass in the stop test."""
    calib_slack: float = 2.0
    """log2 safety margin of the unread-mass estimate: added to the observed bound tightness ('calibrated') or
    gap ('mean'), and the factor ``2^calib_slack`` on the sketch's unread share ('sketch', both schedules)."""
    chunk_growth: int = 16
    """stop-test granularity: ranked chunks are micro_batch_blocks long until 16 * m ranks, then
    the largest power of two <= ranks_read / chunk_growth (<= max_chunk_blocks); 0 = always m."""
    max_chunk_blocks: int = 256
    """largest chunk (power of two >= micro_batch_blocks)."""
    sorted_prefix_blocks: int = 1024
    """ranking: the top ``sorted_prefix_blocks`` blocks exactly sorted, the others after them in block
    order (:mod:`flashinfer_ext.psa.rank_select`; only pairs reading more blocks see the difference);
    0 = a full device sort. A power of two in [16, 8192]; raised to cover sink + local blocks."""

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
        if self.criticality not in ("cuboid", "mean", "sketch"):
            raise bad("criticality", "one of 'cuboid', 'mean', 'sketch'")
        if (self.estimator == "sketch") != (self.criticality == "sketch"):
            raise ValueError(f"PsaDecodeConfig.estimator={self.estimator!r} with criticality={self.criticality!r}: "
                             f"the 'sketch' estimator and the 'sketch' criticality go together (the stop test "
                             f"reads the sketch's shares)")
        if self.schedule not in ("progressive", "select"):
            raise bad("schedule", "one of 'progressive', 'select'")
        if self.schedule == "select" and self.estimator != "sketch":
            raise ValueError(f"PsaDecodeConfig.schedule='select' needs estimator='sketch' (it selects from the "
                             f"sketch's shares); got estimator={self.estimator!r}")
        if self.group_reduce not in ("max", "sum"):
            raise bad("group_reduce", "one of 'max', 'sum'")
        if self.rank_by not in ("criticality", "mean"):
            raise bad("rank_by", "one of 'criticality', 'mean'")
        if self.estimator not in ESTIMATORS:
            raise bad("estimator", "one of " + ", ".join(repr(e) for e in ESTIMATORS))
        if self.estimator == "mean" and (self.criticality != "mean" or self.group_reduce != "max"):
            raise ValueError(f"PsaDecodeConfig.estimator='mean' needs criticality='mean' and group_reduce='max' "
                             f"(it estimates unread blocks from q . mean key); got criticality={self.criticality!r}, "
                             f"group_reduce={self.group_reduce!r}")
        if self.estimator in ("bound", "calibrated") and (self.criticality != "cuboid" or self.group_reduce != "max"):
            raise ValueError(f"PsaDecodeConfig.estimator={self.estimator!r} needs criticality='cuboid' and "
                             f"group_reduce='max' (the score must bound every key of the group); got "
                             f"criticality={self.criticality!r}, group_reduce={self.group_reduce!r}")
        if isinstance(self.calib_slack, bool) or not isinstance(self.calib_slack, (int, float)) \
                or not (0.0 <= float(self.calib_slack) <= 64.0):
            raise bad("calib_slack", "a number in [0, 64]")
        object.__setattr__(self, "calib_slack", float(self.calib_slack))
        v = self.chunk_growth
        if isinstance(v, bool) or not isinstance(v, int) or not (v == 0 or 2 <= v <= 1024):
            raise bad("chunk_growth", "0 or an integer in [2, 1024]")
        v = self.max_chunk_blocks
        if isinstance(v, bool) or not isinstance(v, int) or not _is_pow2(v) \
                or not (self.micro_batch_blocks <= v <= 1 << 16):
            raise bad("max_chunk_blocks", f"a power of two in [micro_batch_blocks={self.micro_batch_blocks}, 65536]")

        v = self.sorted_prefix_blocks
        if isinstance(v, bool) or not isinstance(v, int) or not (v == 0 or (_is_pow2(v) and 16 <= v <= 8192)):
            raise bad("sorted_prefix_blocks", "0 or a power of two in [16, 8192]")

    def ranking_prefix(self) -> int:
        """Effective sorted prefix (0 = full sort): ``sorted_prefix_blocks`` raised to cover the forced blocks."""
        v = self.sorted_prefix_blocks
        if not v:
            return 0
        return max(v, 1 << max(0, (self.sink_blocks + self.local_blocks - 1).bit_length()))

    def ranked_chunk_ends(self, n_ranked: int) -> list[int]:
        """Cumulative ends (in ranks after the forced blocks) of the ranked chunks covering ``n_ranked``.

        The stop test runs after each chunk. Chunk sizes: ``micro_batch_blocks`` while fewer than
        ``chunk_growth * micro_batch_blocks`` ranks were read, then the largest power of two
        ``<= ranks_read / chunk_growth`` capped at ``max_chunk_blocks`` (so the test overshoots the
        needed reads by at most ~1/chunk_growth). Independent of batch and wave layout.
        """
        m, div, cap = self.micro_batch_blocks, self.chunk_growth, self.max_chunk_blocks
        ends, pos = [], 0
        while pos < n_ranked:
            c = m
            if div and pos >= div * m:
                c = min(cap, max(m, 1 << ((pos // div).bit_length() - 1)))
            pos += c
            ends.append(pos)
        return ends
