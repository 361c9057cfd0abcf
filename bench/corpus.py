"""Offline real-prose corpus for haystacks.

Source: the CPython standard library module ``pydoc_data.topics``. It holds the text of
the *Python Language Reference* and of the library reference's built-in types chapters
(the help topics that ``help("if")`` prints), written by the Python documentation
authors as English explanatory prose. It ships with every CPython installation (3.8+),
so it exists on the CPU machine and on the GPU device kit without any download, and
its content is fixed by the interpreter version (we record that version in reports).

We keep only paragraphs that read as prose: no indented code/grammar blocks, mostly
letters and spaces, ending with a full stop, at least ~30 words. Digits are removed
from kept paragraphs so planted numbers are the only numbers in a haystack.
"""

from __future__ import annotations

import random
import re
import sys
from functools import lru_cache

SOURCE_NAME = "CPython stdlib pydoc_data.topics (Python Language Reference text)"


def source_description() -> str:
    """One line naming the corpus and the interpreter version it came from."""
    return f"{SOURCE_NAME}, Python {sys.version.split()[0]}"


def _is_prose(raw: str, flat: str) -> bool:
    if raw.startswith((" ", "\t")) or len(flat.split()) < 30 or not flat.endswith("."):
        return False
    if any(tok in flat for tok in ("::=", ">>>", "__", "...", "|")):
        return False
    letters = sum(c.isalpha() or c == " " for c in flat)
    return letters / len(flat) > 0.93


@lru_cache(maxsize=1)
def paragraphs() -> tuple[str, ...]:
    """All prose paragraphs of the corpus, in a fixed order (sorted topic keys)."""
    try:
        from pydoc_data.topics import topics
    except ImportError as e:  # pragma: no cover - stripped interpreters only
        raise RuntimeError("bench corpus needs the stdlib module pydoc_data.topics, "
                           "which this Python installation lacks") from e
    out = []
    for key in sorted(topics):
        for raw in re.split(r"\n\s*\n", topics[key]):
            flat = re.sub(r"\s*\d+(?:[.,]\d+)*", "", " ".join(raw.split())).replace('"', "")
            if _is_prose(raw, flat):
                out.append(flat)
    if len(out) < 100:
        raise RuntimeError(f"bench corpus: only {len(out)} prose paragraphs found in pydoc_data.topics")
    return tuple(out)


def haystack(n_words: int, rng: random.Random) -> list[str]:
    """Return whole paragraphs, drawn without replacement in a seeded order, totalling
    at least ``n_words`` words (the corpus is reshuffled and reused for very long
    haystacks, e.g. speed runs far beyond 8k tokens)."""
    paras = list(paragraphs())
    out: list[str] = []
    words = 0
    while words < n_words:
        order = paras[:]
        rng.shuffle(order)
        for p in order:
            out.append(p)
            words += len(p.split())
            if words >= n_words:
                break
    return out
