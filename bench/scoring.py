"""Scorers: task metrics (exact match, F1, Rouge-L) and fidelity against dense.

Task metrics compare a reply with the gold answers of a turn. Fidelity metrics compare
a sparse mode with the dense run on the same prompts: greedy token agreement over the
first 128 generated tokens, and teacher-forced top-1 agreement / KL from the server's
top-k logprobs. Pure python, no server.
"""

from __future__ import annotations

import math
import re
import string

GREEDY_TOKENS = 128


def normalize(text: str) -> list[str]:
    """SQuAD-style normalisation: lower case, strip punctuation and articles, split."""
    text = text.lower()
    text = "".join(" " if c in string.punctuation else c for c in text)
    return [w for w in text.split() if w not in ("a", "an", "the")]


def exact_match(reply: str, answers: tuple[str, ...] | list[str]) -> float:
    """1.0 if every gold answer occurs as a whole token in the reply (answers are short
    numbers, so containment is the right notion of 'exact' for a chatty model)."""
    toks = set(normalize(reply))
    return float(all(a.lower() in toks for a in answers))


def f1(reply: str, answers: tuple[str, ...] | list[str]) -> float:
    """Token F1 between the reply's numbers (or all tokens if the gold is not numeric)
    and the gold answers, multiset overlap as in SQuAD/LongBench."""
    gold = [t for a in answers for t in normalize(a)]
    pred = normalize(reply)
    if all(t.isdigit() for t in gold):
        pred = [t for t in pred if t.isdigit()]
    if not gold or not pred:
        return float(gold == pred)
    common = 0
    rest = list(pred)
    for g in gold:
        if g in rest:
            rest.remove(g)
            common += 1
    if common == 0:
        return 0.0
    p, r = common / len(pred), common / len(gold)
    return 2 * p * r / (p + r)


def _lcs(a: list[str], b: list[str]) -> int:
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l(reply: str, reference: str) -> float:
    """Rouge-L F-measure (beta = 1) on normalised tokens."""
    a, b = normalize(reply), normalize(reference)
    if not a or not b:
        return float(a == b)
    lcs = _lcs(a, b)
    if lcs == 0:
        return 0.0
    p, r = lcs / len(a), lcs / len(b)
    return 2 * p * r / (p + r)


def task_scores(reply: str, answers: tuple[str, ...], metric: str) -> dict[str, float]:
    """All three metrics plus ``score``: the one the turn's task is judged by."""
    s = {"em": exact_match(reply, answers), "f1": f1(reply, answers),
         "rouge_l": rouge_l(reply, " ".join(answers))}
    if metric not in s:
        raise ValueError(f"unknown metric '{metric}'")
    s["score"] = s[metric]
    return s


# ---------------------------------------------------------------- fidelity vs dense

def greedy_agreement(dense_ids: list[int], other_ids: list[int], n: int = GREEDY_TOKENS) -> dict[str, float]:
    """Agreement of two greedy outputs over their first ``n`` tokens.

    ``prefix``: length of the common prefix / compared length (1.0 = identical);
    ``positional``: fraction of positions with the same token; ``exact``: identical.
    The compared length is max of the two (capped at n), so a shorter or longer output
    counts as disagreement on the missing positions.
    """
    a, b = list(dense_ids[:n]), list(other_ids[:n])
    m = max(len(a), len(b))
    if m == 0:
        return {"prefix": 1.0, "positional": 1.0, "exact": 1.0}
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    same = sum(x == y for x, y in zip(a, b))
    return {"prefix": k / m, "positional": same / m, "exact": float(a == b)}


def _topk(entry) -> dict[int, float]:
    """SGLang top-logprob entry [[logprob, token_id, text], ...] -> {token_id: logprob}."""
    return {int(t[1]): float(t[0]) for t in (entry or []) if t is not None and t[0] is not None}


def kl_top1(dense_top: list, other_top: list) -> dict[str, float]:
    """Teacher-forced fidelity over aligned positions of two ``input_top_logprobs`` lists.

    KL(P_dense || Q_other) is estimated from the top-k lists: over dense's top-k tokens,
    with q taken from the other run's top-k, or, where a token is missing there, from the
    smallest of its top-k probabilities (an upper bound on q, so a lower bound on that
    term); the remaining mass of both sides forms one tail bucket. Exact (0) when the two
    distributions agree. ``top1``: fraction of positions with the same argmax.
    """
    kls, top1 = [], []
    for de, oe in zip(dense_top, other_top):
        p, q = _topk(de), _topk(oe)
        if not p or not q:
            continue
        top1.append(float(max(p, key=p.get) == max(q, key=q.get)))
        qmin = min(q.values())
        kl = 0.0
        ps = qs = 0.0
        for tok, lp in p.items():
            lq = q.get(tok, qmin)
            pp = math.exp(lp)
            kl += pp * (lp - lq)
            ps += pp
            qs += math.exp(lq)
        pt, qt = max(0.0, 1.0 - ps), max(1e-12, 1.0 - qs)
        if pt > 1e-12:
            kl += pt * math.log(pt / qt)
        kls.append(max(0.0, kl))
    n = len(top1)
    return {"positions": n, "top1": sum(top1) / n if n else float("nan"),
            "kl": sum(kls) / n if n else float("nan"), "kl_max": max(kls) if kls else float("nan")}


def extract_numbers(text: str) -> list[str]:
    return re.findall(r"\d+", text)
