"""Paired comparison of a sparse mode with dense on the same headline tasks, per question position.

The headline accuracy ratio (mode accuracy / dense accuracy) hides how many tasks actually differ and how
precise the ratio is. Both runs answer the *same* tasks, so per position this gives:

  * ``n``: headline tasks answered by both runs (matched by ``task_id``);
  * ``dense_score`` / ``mode_score``: summed scores (EM tasks: tasks answered right);
  * ``mode_only`` / ``dense_only``: tasks the mode scores higher / lower than dense (the discordant pairs);
  * ``ratio``: ``mode_score / dense_score`` over those tasks;
  * ``ratio_ci95``: a paired percentile bootstrap (tasks resampled with replacement, the same draw for
    both runs; ``n_boot`` draws from ``random.Random(seed)``), so the interval reflects how much the ratio
    moves with the task sample.

Pure python on the harness's raw records (``raw/<mode>.json``); nothing typed in.
"""

from __future__ import annotations

import random

from bench.conc_stats import percentile
from bench.report import headline_rows
from bench.tasks import POSITIONS, Preset


def headline_scores(rec: dict, preset: Preset) -> dict[str, tuple[str, float]]:
    """``{task_id: (question position, last-turn score)}`` of the headline tasks of one mode's raw record."""
    return {r["task_id"]: (r["task_position"], float(r["score"])) for r in headline_rows(rec, preset)}


def paired_by_position(dense_rec: dict, mode_rec: dict, preset: Preset, n_boot: int = 2000,
                       seed: int = 0) -> dict[str, dict]:
    """Per question position: the paired figures of the module docstring (``ratio``/``ratio_ci95`` None
    when dense scores 0 there; the interval drops draws where dense scores 0)."""
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot}")
    d, m = headline_scores(dense_rec, preset), headline_scores(mode_rec, preset)
    rng = random.Random(seed)
    out = {}
    for pos in POSITIONS:
        ids = sorted(t for t in d if t in m and d[t][0] == pos)
        pairs = [(d[t][1], m[t][1]) for t in ids]
        ds, ms = sum(a for a, _ in pairs), sum(b for _, b in pairs)
        boot = []
        if pairs and ds > 0:
            for _ in range(n_boot):
                draw = [pairs[rng.randrange(len(pairs))] for _ in pairs]
                den = sum(a for a, _ in draw)
                if den > 0:
                    boot.append(sum(b for _, b in draw) / den)
        out[pos] = {"n": len(pairs), "dense_score": ds, "mode_score": ms,
                    "mode_only": sum(b > a for a, b in pairs), "dense_only": sum(a > b for a, b in pairs),
                    "ratio": ms / ds if ds > 0 else None,
                    "ratio_ci95": [percentile(boot, 2.5), percentile(boot, 97.5)] if boot else None}
    return out
