"""Long-context task kinds (the ``long`` presets): real lengths, on the 32k testbed.

Sizes are given in **tokens** of the SmolLM2 tokenizer and turned into corpus words with
:data:`TOKENS_PER_WORD` (measured on :mod:`bench.corpus`: 1.22-1.27 tokens a word); the
scored prompt length reported by the server is what the length buckets use.

Kinds:

* ``chat3``   3 user turns of 1.5k-8k tokens each (one size per turn, drawn from
              :data:`CHAT_TURN_TOKENS`). Turn 1 plants fact A and asks for it; turn 2 plants
              fact B and asks for it; turn 3 (new text, a colour fact) asks for A again (recall of
              turn 1). The question sits at the task's position (begin / middle / end) of every
              turn, and every turn is scored. The conversation is re-sent each turn with the
              server's own earlier replies, as a client does.
* ``needle``  1 turn of ``tokens`` tokens with one fact at a depth of 10 / 50 / 90 % of the
  (depth)     text and the question last. Its ``position`` names the depth: begin = 10 %,
              middle = 50 %, end = 90 % (:data:`DEPTHS`).
* ``rag``     ``docs`` titled documents of 0.5k-4k tokens each (the total kept under
              :data:`RAG_MAX_TOKENS`); one holds the fact, each other one a colour fact. Stock
              layout: the documents inlined in the user message with the question at the
              task's position. The same task carries its documents and question apart
              (``meta["documents"]``, ``meta["question"]``) for a documents API (``--sparse samkv``),
              scored against the same stock baseline.

Everything is a pure function of its arguments (seeded), so every mode sees identical tasks.
"""

from __future__ import annotations

import random

from bench import tasks as base

TOKENS_PER_WORD = 1.26
CHAT_TURN_TOKENS = (1536, 3072, 5120, 8192)
DEPTHS = {"begin": 0.10, "middle": 0.50, "end": 0.90}
RAG_DOC_TOKENS = (512, 4096)
RAG_MAX_TOKENS = 28000
LONG_KINDS = ("chat3", "needle_depth", "rag")


def words_for(tokens: int) -> int:
    """Corpus words that make about ``tokens`` tokens."""
    return max(1, int(tokens / TOKENS_PER_WORD))


def _haystack_with_fact(tokens: int, fact: str, depth: float, rng: random.Random) -> list[str]:
    """Paragraphs of about ``tokens`` tokens with ``fact`` inserted as its own paragraph at
    the paragraph boundary nearest ``depth`` (0-1) of the words."""
    paras = base.corpus.haystack(words_for(tokens), rng)
    total = sum(len(p.split()) for p in paras)
    acc, at = 0, len(paras)
    for i, p in enumerate(paras):
        if acc >= depth * total:
            at = i
            break
        acc += len(p.split())
    return paras[:at] + [fact] + paras[at:]


def make_chat3(position: str, seed: int, turn_tokens: tuple[int, ...] = CHAT_TURN_TOKENS) -> base.Task:
    """Three scored turns; turn sizes drawn from ``turn_tokens`` (smaller sets for CPU runs)."""
    rng = random.Random(f"chat3|{position}|{seed}|{turn_tokens}")
    d = base._Draw(rng)
    sizes = [rng.choice(turn_tokens) for _ in range(3)]
    a, b = (d.name(), d.number()), (d.name(), d.number())
    planted = [base._fact(*a), base._fact(*b), base._distractor(d.name(), rng.choice(base.COLOURS))]
    asks = [a, b, a]
    turns = []
    for j in range(3):
        paras = base._turn_text(words_for(sizes[j]), [planted[j]], rng)
        user = base._place_question(paras, base._question([asks[j][0]]), position)
        turns.append(base.Turn(user, (asks[j][1],), position, (0 if j != 1 else 1,), "em"))
    return base.Task(f"chat3-{position}-t{max(turn_tokens)}-s{seed}", "chat3", position,
                     sum(words_for(s) for s in sizes), tuple(turns), meta={"turn_tokens": sizes, "scored_turns": "all"})


def make_needle_depth(position: str, tokens: int, seed: int) -> base.Task:
    if position not in DEPTHS:
        raise ValueError(f"needle position must be one of {tuple(DEPTHS)}, got {position!r}")
    rng = random.Random(f"needle_depth|{position}|{tokens}|{seed}")
    d = base._Draw(rng)
    name, number = d.name(), d.number()
    paras = _haystack_with_fact(tokens, base._fact(name, number), DEPTHS[position], rng)
    user = base._place_question(paras, base._question([name]), "end")
    turn = base.Turn(user, (number,), "end", (0,), "em")
    return base.Task(f"needle_depth-{position}-t{tokens}-s{seed}", "needle_depth", position, words_for(tokens),
                     (turn,), meta={"tokens": tokens, "depth": DEPTHS[position]})


def rag_doc_tokens(docs: int, rng: random.Random) -> list[int]:
    """Per-document sizes in [512, 4096] tokens, the largest allowed shrunk so the total stays
    under :data:`RAG_MAX_TOKENS`."""
    hi = max(RAG_DOC_TOKENS[0], min(RAG_DOC_TOKENS[1], RAG_MAX_TOKENS // docs))
    return [rng.randint(RAG_DOC_TOKENS[0], hi) for _ in range(docs)]


def make_rag(position: str, docs: int, seed: int, doc_tokens: tuple[int, int] | None = None) -> base.Task:
    """``docs`` documents (sizes from :func:`rag_doc_tokens`, or uniform in ``doc_tokens``)."""
    if docs < 2:
        raise ValueError(f"rag needs docs >= 2, got {docs}")
    rng = random.Random(f"rag|{position}|{docs}|{doc_tokens}|{seed}")
    d = base._Draw(rng)
    sizes = rag_doc_tokens(docs, rng) if doc_tokens is None else [rng.randint(*doc_tokens) for _ in range(docs)]
    need = rng.randrange(docs)
    name, number = d.name(), d.number()
    titles = [base.DOC_TITLES[i % len(base.DOC_TITLES)] + (f" ({i // len(base.DOC_TITLES) + 1})"
                                                          if i >= len(base.DOC_TITLES) else "")
              for i in rng.sample(range(max(docs, len(base.DOC_TITLES))), docs)]
    documents = []
    for i in range(docs):
        fact = base._fact(name, number) if i == need else base._distractor(d.name(), rng.choice(base.COLOURS))
        paras = base._turn_text(words_for(sizes[i]), [fact], rng)
        documents.append(f"Document {i + 1}: {titles[i]}\n" + " ".join(paras))
    question = base._question([name])
    user = base._place_question(documents, question, position)
    turn = base.Turn(user, (number,), position, (0,), "em")
    return base.Task(f"rag-{position}-d{docs}-s{seed}", "rag", position, sum(words_for(s) for s in sizes), (turn,),
                     meta={"docs": docs, "needed_docs": [need + 1], "doc_tokens": sizes, "documents": documents,
                           "question": question + "\n\n" + base.TRAILER})


def generate_long(spec, position: str, i: int, seed: int) -> base.Task:
    """One task of a :class:`LongSpec` row."""
    s = seed * 100003 + i
    if spec.kind == "chat3":
        return make_chat3(position, s, spec.turn_tokens or CHAT_TURN_TOKENS)
    if spec.kind == "needle_depth":
        return make_needle_depth(position, spec.tokens, s)
    if spec.kind == "rag":
        return make_rag(position, spec.docs, s, spec.doc_tokens)
    raise ValueError(f"unknown long task kind {spec.kind!r}; expected one of {LONG_KINDS}")
