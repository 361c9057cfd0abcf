"""No development history in the user-facing tree.

README, docs, benchmark reports and the library/benchmark sources (docstrings, comments, help
text) describe the product as it is. Development history (run ordinals like "stop 14",
per-run result folders, machine counts, run dates, issue numbers) belongs in git history.

Fast CPU test: reads text files only. Excluded: tests/ (fixtures may name runs), .venv, models,
scripts/gpu (device scripts may name their runs) and bench/results/*.json (measured data may carry
timestamps); bench/results/*.md are checked.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# (name, pattern): each a development-history marker
MARKERS: tuple[tuple[str, re.Pattern], ...] = tuple(
    (name, re.compile(rx, re.IGNORECASE))
    for name, rx in (
        ("run ordinal", r"\bstops? \d+\b"),
        ("per-run folder", r"\b(?:gpu|cpu)_s\d+"),
        ("per-run folder", r"bench/results/(?:gpu|cpu)_\w+/"),
        ("machine ordinal", r"\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth) machine\b"),
        ("machine number", r"\bmachines? \d+\b"),
        ("run date", r"\b20[2-9]\d-[01]\d-[0-3]\d\b"),
        ("issue number", r"\bissues? #?\d+\b"),
    )
)

EXCLUDED_DIRS = {"tests", ".venv", "models", "__pycache__", ".git"}


def checked_files(root: Path = ROOT) -> list[Path]:
    """The files the test reads (existing ones only)."""
    files: list[Path] = [root / "README.md", root / "bench" / "README.md"]
    files += sorted((root / "docs").glob("*.md"))
    files += sorted((root / "bench" / "results").glob("*.md"))
    for pkg in ("sglang_sparse", "radix_sparse", "flashinfer_ext", "bench"):
        for p in sorted((root / pkg).rglob("*.py")):
            rel = p.relative_to(root).parts
            if EXCLUDED_DIRS.intersection(rel) or rel[:2] == ("scripts", "gpu"):
                continue
            files.append(p)
    return [p for p in dict.fromkeys(files) if p.is_file()]


def find_markers(text: str) -> list[tuple[int, str, str]]:
    """``(line number, marker name, matched text)`` for every marker in ``text``."""
    hits = []
    for n, line in enumerate(text.splitlines(), 1):
        for name, rx in MARKERS:
            for m in rx.finditer(line):
                hits.append((n, name, m.group(0)))
    return hits


@pytest.mark.parametrize("line", [
    "measured in stop 14 on the H100",
    "Stops 11-15 changed the kernel",
    "see bench/results/gpu_s20/README.md",
    "the cpu_s3 probes",
    "bench/results/cpu_dense/report.md",
    "on the fifth machine",
    "machine 3 ran the harness",
    "H100, 2026-11-24",
    "GPU part of issue 5",
    "host-tier keys (issue #6)",
])
def test_markers_match_history(line):
    assert find_markers(line), f"no marker matched {line!r}"


@pytest.mark.parametrize("line", [
    "decode stops once the kept mass reaches epsilon",
    "the stop test runs on the GPU",
    "one machine with 8 GPUs",
    "gpu_cache_mb 64, 16 tokens per page",
    "min_context 24576",
])
def test_markers_leave_plain_text(line):
    assert not find_markers(line), f"{line!r} matched {find_markers(line)}"


def test_checked_files_cover_the_tree():
    names = {p.relative_to(ROOT).as_posix() for p in checked_files()}
    assert "README.md" in names
    assert any(n.startswith("docs/") for n in names)
    assert any(n.startswith("sglang_sparse/") for n in names)
    assert any(n.startswith("flashinfer_ext/") for n in names)
    assert not any(n.startswith(("tests/", "scripts/gpu/")) or n.endswith(".json") for n in names)


def _measurement_stamp(path: Path, line: str) -> bool:
    """A benchmark report's own metadata line (``- date_utc: ...``) records when it was measured, like its GPU
    and versions: data, not development history."""
    return path.parent.name == "results" and line.lstrip().startswith("- date_utc:")


def test_no_development_history():
    found = []
    for p in checked_files():
        text = p.read_text(encoding="utf-8", errors="replace")
        lines = text.splitlines()
        for n, name, match in find_markers(text):
            if name == "run date" and _measurement_stamp(p, lines[n - 1]):
                continue
            found.append(f"{p.relative_to(ROOT).as_posix()}:{n}: {name}: {match!r}")
    assert not found, "development history in the user-facing tree:\n" + "\n".join(found)
