"""Offline multi-turn long-context task generator (after LoopServe §4).

Every task is a conversation of one or more user turns. Each turn's input is a
haystack of real prose (:mod:`bench.corpus`) with planted facts ("<Name>'s secret
number is <4 digits>.") and one question placed at the ``begin``, ``middle`` or ``end``
of that input. The answer may need the current turn, one earlier turn, or two earlier
turns (diverse query relevance), and in the multi-document variant one or two of D
titled documents (SamKV-style retrieval-augmented input).

Kinds:

* ``needle``      1 turn; the fact is in the question's own turn.
* ``recall``      2 turns; turn 1 asks about its own fact, turn 2 (new text, new fact)
                  asks about the fact of turn 1.
* ``recall2``     3 turns; turn 3 asks for the numbers of turn 1 *and* turn 2.
* ``multidoc``    1 turn, D documents; the question needs one document.
* ``multidoc2``   1 turn, D documents; the question needs two documents.

Everything is a pure function of (preset, seed): same inputs, same tasks.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field

from bench import corpus

POSITIONS = ("begin", "middle", "end")
KINDS = ("needle", "recall", "recall2", "multidoc", "multidoc2")

SYSTEM_PROMPT = ("You answer questions about texts the user sends. The question can appear anywhere "
                 "in a message and can be about an earlier message. Reply with the number only.")
TRAILER = "Answer the question above with the number only."
# The assistant turn is opened with this generic text (SGLang ``continue_final_message``);
# it names neither person nor number. Measured on dense SmolLM2-135M (CPU, n=10-12 per
# position): without it the model often summarises the haystack instead of answering
# (recall begin/middle 0.40/0.40, multidoc 0.50/0.40); with it recall 0.6/0.8/1.0,
# multidoc 0.7/0.6/1.0, needle (60 words) 1.0/1.0/1.0.
ANSWER_PREFIX = "The answer is"

NAMES = ("Alice", "Bruno", "Carmen", "Dmitri", "Elena", "Farid", "Greta", "Hiro", "Ingrid", "Jonas",
         "Kofi", "Lucia", "Marek", "Nadia", "Oscar", "Priya", "Quentin", "Rosa", "Stefan", "Tamara")
DOC_TITLES = ("Notes on Evaluation", "Notes on Names", "Notes on Classes", "Notes on Modules",
              "Notes on Errors", "Notes on Types", "Notes on Scopes", "Notes on Calls",
              "Notes on Objects", "Notes on Numbers", "Notes on Loops", "Notes on Imports")


@dataclass(frozen=True)
class Turn:
    """One user turn: its full input text, the gold answers its question needs, where
    the question sits, which turns (0-based) hold the needed facts, and its metric
    (``em``: every gold number in the reply; ``f1``: token F1 of numbers)."""

    user: str
    answers: tuple[str, ...]
    position: str
    sources: tuple[int, ...]
    metric: str = "em"


@dataclass(frozen=True)
class Task:
    task_id: str
    kind: str
    position: str
    words: int
    turns: tuple[Turn, ...]
    system: str = SYSTEM_PROMPT
    answer_prefix: str = ANSWER_PREFIX
    meta: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class KindSpec:
    """How many tasks of a kind per question position, and the haystack size in words
    per turn (per document for multidoc kinds)."""

    kind: str
    per_position: int
    words: int
    docs: int = 0


@dataclass(frozen=True)
class LongSpec:
    """A long-context kind (:mod:`bench.tasks_long`), sized in tokens: ``per_position`` tasks per
    question position (needle: per depth). ``tokens``: needle haystack; ``docs`` / ``doc_tokens``:
    rag documents (default sizes 0.5k-4k); ``turn_tokens``: chat3 turn sizes (default 1.5k-8k)."""

    kind: str
    per_position: int
    tokens: int = 0
    docs: int = 0
    turn_tokens: tuple[int, ...] = ()
    doc_tokens: tuple[int, int] | None = None

    @property
    def words(self) -> int:
        return 0


@dataclass(frozen=True)
class Preset:
    name: str
    kinds: tuple  # of KindSpec / LongSpec
    accuracy_kinds: tuple[str, ...]   # kinds in the headline accuracy_by_position
    fidelity_prompts: int             # raw-text prompts for teacher-forced / greedy fidelity
    fidelity_words: int
    max_tokens: int = 24              # reply budget for task turns
    description: str = ""
    long: bool = False                # headline over every scored turn of every kind (bench.report_long)


PRESETS: dict[str, Preset] = {
    # CI: trivially short contexts, a handful of requests, well under a minute of CPU requests.
    "tiny": Preset("tiny", (KindSpec("needle", 2, 40), KindSpec("recall", 1, 40),
                            KindSpec("multidoc", 1, 20, docs=2)),
                   accuracy_kinds=("needle", "recall", "multidoc"), fidelity_prompts=1, fidelity_words=60,
                   description="CI smoke: short haystacks"),
    # CPU measurement preset: the lengths at which dense SmolLM2-135M was measured to
    # score >= 0.6 at every question position.
    "cpu": Preset("cpu", (KindSpec("needle", 12, 60), KindSpec("recall", 10, 40),
                          KindSpec("recall2", 4, 40), KindSpec("multidoc", 10, 30, docs=3),
                          KindSpec("multidoc2", 4, 30, docs=3)),
                  accuracy_kinds=("needle", "recall", "multidoc"), fidelity_prompts=6, fidelity_words=300,
                  description="CPU dense measurement"),
    # GPU baseline: the accuracy suite at the CPU-validated lengths with more seeds, plus
    # long-context variants up to ~7k tokens (accuracy reported; compared mainly through
    # the fidelity metrics, since a 135M model is unreliable there).
    "full": Preset("full", (KindSpec("needle", 30, 60), KindSpec("recall", 20, 40),
                            KindSpec("recall2", 10, 40), KindSpec("multidoc", 20, 30, docs=3),
                            KindSpec("multidoc2", 10, 30, docs=3),
                            KindSpec("needle", 10, 1000), KindSpec("needle", 10, 5000),
                            KindSpec("recall", 8, 2400), KindSpec("multidoc", 8, 800, docs=5)),
                   accuracy_kinds=("needle", "recall", "multidoc"), fidelity_prompts=30, fidelity_words=2000,
                   description="GPU baseline"),
    # GPU headline accuracy: only the full preset's short (headline) kinds, with 2x its seeds (the full
    # preset's tasks are the first half of each kind), for short-context accuracy ratios: at 70 tasks per
    # question position one task is 1.4 % of dense accuracy; here 140 per position (0.7 %).
    "headline": Preset("headline", (KindSpec("needle", 60, 60), KindSpec("recall", 40, 40),
                                    KindSpec("multidoc", 40, 30, docs=3)),
                       accuracy_kinds=("needle", "recall", "multidoc"), fidelity_prompts=30, fidelity_words=2000,
                       description="GPU headline accuracy, 140 tasks per question position"),
    # The long-context testbed (SmolLM2 with YaRN x4, 32k; build_model --context 32768): 150 scored
    # turns per question position: chat3 20 conversations x 3 turns, needle 15 per length (8k / 16k /
    # 32k) per depth, rag 15 per document count (4 / 8 / 16 of 0.5k-4k tokens).
    "long": Preset("long", (LongSpec("chat3", 20),
                            LongSpec("needle_depth", 15, tokens=7680), LongSpec("needle_depth", 15, tokens=15872),
                            LongSpec("needle_depth", 15, tokens=30720),
                            LongSpec("rag", 15, docs=4), LongSpec("rag", 15, docs=8), LongSpec("rag", 15, docs=16)),
                   accuracy_kinds=("chat3", "needle_depth", "rag"), fidelity_prompts=6, fidelity_words=9000,
                   description="long-context testbed (32k), 150 scored turns per position", long=True),
    # The dense needle table of the testbed: 30 needles per (length, depth).
    "needle_table": Preset("needle_table", tuple(LongSpec("needle_depth", 30, tokens=t)
                                                 for t in (3840, 7680, 15872, 23808, 30720)),
                           accuracy_kinds=("needle_depth",), fidelity_prompts=0, fidelity_words=0,
                           description="dense needle retrieval by length and depth", long=True),
    # x8 YaRN (64k profile): does dense still retrieve? 10 needles per (length, depth).
    "needle_table_64k": Preset("needle_table_64k", tuple(LongSpec("needle_depth", 10, tokens=t)
                                                         for t in (30720, 46080, 62464)),
                               accuracy_kinds=("needle_depth",), fidelity_prompts=0, fidelity_words=0,
                               description="dense needle retrieval at the 64k (YaRN x8) profile", long=True),
    # CPU / CI form of every long kind: short lengths, a handful of tasks.
    "long_cpu": Preset("long_cpu", (LongSpec("chat3", 1, turn_tokens=(160, 240)),
                                    LongSpec("needle_depth", 1, tokens=320),
                                    LongSpec("rag", 1, docs=3, doc_tokens=(80, 140))),
                       accuracy_kinds=("chat3", "needle_depth", "rag"), fidelity_prompts=1, fidelity_words=200,
                       max_tokens=12, description="CI form of the long kinds", long=True),
}
# Headline accuracy uses only the short (validated) lengths of accuracy_kinds.
HEADLINE_MAX_WORDS = 250


COLOURS = ("red", "green", "blue", "yellow", "purple", "orange", "brown", "grey")


def _fact(name: str, number: str) -> str:
    return f"{name}'s secret number is {number}."


def _distractor(name: str, colour: str) -> str:
    """A fact of another type: later turns carry one, so their text is not fact-free,
    but only the asked-for earlier turn holds a secret number about that person."""
    return f"{name}'s favourite colour is {colour}."


def _question(names: list[str]) -> str:
    if len(names) == 1:
        return f"Question: What is {names[0]}'s secret number?"
    return f"Question: What are the secret numbers of {names[0]} and {names[1]}?"


def _plant(paras: list[str], fact: str, rng: random.Random) -> list[str]:
    out = paras[:]
    out.insert(rng.randint(0, len(out)), fact)
    return out


def _place_question(blocks: list[str], question: str, position: str) -> str:
    """Join text blocks with the question at the beginning, between the two middle
    blocks, or at the end; the fixed trailer always closes the input."""
    if position == "begin":
        parts = [question] + blocks
    elif position == "end":
        parts = blocks + [question]
    elif position == "middle":
        mid = max(1, len(blocks) // 2) if len(blocks) > 1 else 1
        parts = blocks[:mid] + [question] + blocks[mid:]
    else:
        raise ValueError(f"unknown question position '{position}'; expected one of {POSITIONS}")
    return "\n\n".join(parts + [TRAILER])


class _Draw:
    """Seeded source of distinct names and numbers for one task."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.names = list(NAMES)
        rng.shuffle(self.names)
        self.used: set[str] = set()

    def name(self) -> str:
        return self.names.pop()

    def number(self) -> str:
        while True:
            n = str(self.rng.randint(1000, 9999))
            if n not in self.used:
                self.used.add(n)
                return n


def _turn_text(words: int, facts: list[str], rng: random.Random) -> list[str]:
    paras = corpus.haystack(words, rng)
    for f in facts:
        paras = _plant(paras, f, rng)
    return paras


def make_task(kind: str, position: str, words: int, seed: int, docs: int = 0) -> Task:
    """Build one task deterministically from its parameters."""
    if kind not in KINDS:
        raise ValueError(f"unknown task kind '{kind}'; expected one of {KINDS}")
    rng = random.Random(f"{kind}|{position}|{words}|{docs}|{seed}")
    d = _Draw(rng)
    tid = f"{kind}-{position}-w{words}" + (f"-d{docs}" if docs else "") + f"-s{seed}"
    turns: list[Turn] = []
    meta: dict = {}
    if kind in ("needle", "recall", "recall2"):
        n_turns = {"needle": 1, "recall": 2, "recall2": 3}[kind]
        # recall: turn 1 plants A and asks about it; turn 2 (new text, a colour fact)
        # asks about A again. recall2: turns 1 and 2 plant A and B and ask about their
        # own fact; turn 3 (new text, a colour fact) asks for both A and B.
        n_numbers = {"needle": 1, "recall": 1, "recall2": 2}[kind]
        facts = [(d.name(), d.number()) for _ in range(n_numbers)]
        for j in range(n_turns):
            last = j == n_turns - 1
            if j < n_numbers:
                planted = [_fact(*facts[j])]
            else:
                planted = [_distractor(d.name(), rng.choice(COLOURS))]
            paras = _turn_text(words, planted, rng)
            if last and j >= n_numbers:
                ask, src = facts, tuple(range(n_numbers))
            else:
                ask, src = [facts[j]], (j,)
            # the task's question position applies to its scored (last) turn; earlier
            # turns ask about their own fact with the question at the end, so the fact
            # is established in the conversation the way a user would do it
            pos = position if last else "end"
            user = _place_question(paras, _question([a[0] for a in ask]), pos)
            turns.append(Turn(user, tuple(a[1] for a in ask), pos, src, "em" if len(ask) == 1 else "f1"))
    else:
        if docs < 2:
            raise ValueError(f"{kind} needs docs >= 2, got {docs}")
        need = 1 if kind == "multidoc" else 2
        titles = rng.sample(DOC_TITLES, docs)
        picked = sorted(rng.sample(range(docs), need))
        # the needed documents hold secret numbers; the others hold a fact of another
        # type about another person, so every document carries a planted fact
        facts = {i: (d.name(), d.number()) for i in picked}
        blocks = []
        for i in range(docs):
            planted = _fact(*facts[i]) if i in facts else _distractor(d.name(), rng.choice(COLOURS))
            paras = _turn_text(words, [planted], rng)
            blocks.append(f"Document {i + 1}: {titles[i]}\n" + " ".join(paras))
        ask = [facts[i] for i in picked]
        user = _place_question(blocks, _question([a[0] for a in ask]), position)
        turns.append(Turn(user, tuple(a[1] for a in ask), position, (0,), "em" if need == 1 else "f1"))
        meta = {"docs": docs, "needed_docs": [i + 1 for i in picked]}
    return Task(tid, kind, position, words, tuple(turns), meta=meta)


def generate(preset: str | Preset, seed: int = 0) -> list[Task]:
    """All tasks of a preset, in a fixed order."""
    p = PRESETS[preset] if isinstance(preset, str) else preset
    out = []
    for spec in p.kinds:
        for position in POSITIONS:
            for i in range(spec.per_position):
                if isinstance(spec, LongSpec):
                    from bench.tasks_long import generate_long
                    out.append(generate_long(spec, position, i, seed))
                else:
                    out.append(make_task(spec.kind, position, spec.words, seed * 100003 + i, spec.docs))
    return out


def fidelity_prompts(preset: str | Preset, seed: int = 0) -> list[tuple[str, str]]:
    """Raw-text (context, continuation) pairs from the corpus: the context is a
    haystack, the continuation the next real paragraph, used for teacher-forced
    next-token agreement/KL and for 128-token greedy agreement."""
    p = PRESETS[preset] if isinstance(preset, str) else preset
    rng = random.Random(f"fidelity|{seed}")
    out = []
    for _ in range(p.fidelity_prompts):
        paras = corpus.haystack(p.fidelity_words + 150, rng)
        cont = paras.pop()
        out.append(("\n\n".join(paras), cont))
    return out
