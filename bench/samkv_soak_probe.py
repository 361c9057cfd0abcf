"""Ask a ``--sparse samkv`` server the soak's RAG questions one combination at a time, per documents variant, and say
whether the kept context held the planted fact.

    python -m bench.samkv_soak_probe --url http://127.0.0.1:30000 --turn-words 7000 \
        --combo P1,S1:P1 --combo S1,P1:S1 --variants samkv,cacheblend,reuse --out probe.json

The soak (``bench.soak``) asks, in its ``rag`` items, about one of two documents: one of its shared documents
(``S0``, ``S1``) and the private document of the item's salt (``P0``, ``P1``, ...), each ~``turn_words`` words with one
planted "access code of the <colour> <animal> locker" statement. A ``--combo`` names the documents in order and the one
asked about (``DOC,DOC:TARGET``); its items are the same whatever their id, so a combination samkv answers wrong in the
soak can be asked again here, with each variant on the same cached documents. Per request: the reply, whether it holds
the answer, the scheduler status, the KV kept ratio, and for variants that drop blocks whether every token of the
asked statement was in the kept ranges (``statement_kept``; positions from the model's tokenizer over the document
text, so they can be off by a token at the document's edges).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import requests

from bench.soak import SoakConfig, Workload


def documents(turn_words: int, salts: int, seed: int) -> dict[str, dict]:
    """The soak's documents by name: ``S<i>`` shared, ``P<k>`` private (salt ``soak-salt-<k>``)."""
    w = Workload(SoakConfig(seed=seed, turn_words=turn_words, salts=salts))
    docs = {f"S{i}": d for i, d in enumerate(w.shared)}
    docs.update({f"P{k.rsplit('-', 1)[1]}": d for k, d in w.private.items()})
    return docs


def parse_combo(text: str, names) -> tuple[list[str], str]:
    order, sep, target = text.partition(":")
    docs = order.split(",")
    if not sep or target not in docs or any(d not in names for d in docs):
        raise ValueError(f"--combo {text!r}: expected DOC,DOC:TARGET with documents among {sorted(names)}")
    return docs, target


def statement_span(tokenizer, text: str) -> tuple[int, int]:
    """Token positions [start, end) of the planted statement inside a document's text."""
    i = text.index("The access code of")
    j = text.index(".", text.index(" is ", i)) + 1
    count = lambda s: len(tokenizer(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    return count(text[:i]), count(text[:j])


def covered(ranges: list[int] | None, span: tuple[int, int]) -> bool | None:
    if not ranges:
        return None
    pairs = list(zip(ranges[::2], ranges[1::2]))
    return all(any(a <= p < b for a, b in pairs) for p in range(*span))


def ask(url: str, docs: dict, order: list[str], target: str, variant: str, max_tokens: int) -> dict:
    d = docs[target]
    private = [n for n in order if n.startswith("P")]
    salt = f"soak-salt-{private[0][1:]}" if private else ""
    messages = [{"role": "user", "content": "Use the documents to answer. " + d["question"]},
                {"role": "assistant", "content": d["prefix"]}]
    t0 = time.time()
    r = requests.post(url + "/v1/chat/completions", timeout=3600, json={
        "model": "default", "messages": messages, "temperature": 0, "max_tokens": max_tokens,
        "continue_final_message": True, "documents": [docs[n]["text"] for n in order], "cache_salt": salt,
        "samkv": {"variant": variant}})
    if r.status_code != 200:
        return {"error": f"HTTP {r.status_code}: {r.text[:300]}"}
    body = r.json()
    meta = (body.get("metadata") or {}).get("sparse") or {}
    reply = body["choices"][0]["message"]["content"] or ""
    return {"reply": reply, "right": d["answer"] in reply, "status": meta.get("scheduler_status"),
            "kv_kept_ratio": meta.get("kv_kept_ratio"), "recomputed_tokens": meta.get("recomputed_tokens"),
            "kept_ranges": meta.get("kept_ranges"), "seconds": round(time.time() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.samkv_soak_probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True, help="a --sparse samkv server (127.0.0.1)")
    ap.add_argument("--model", help="tokenizer folder for statement_kept (default: none, not reported)")
    ap.add_argument("--combo", action="append", required=True, help="DOC,DOC:TARGET, e.g. P1,S1:P1 (repeat)")
    ap.add_argument("--variants", default="samkv", help="comma-separated documents variants (default samkv)")
    ap.add_argument("--turn-words", type=int, default=7000, help="the soak's --turn-words (default 7000)")
    ap.add_argument("--salts", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--out", help="JSON report")
    a = ap.parse_args(argv)
    docs = documents(a.turn_words, a.salts, a.seed)
    try:
        combos = [parse_combo(c, docs) for c in a.combo]
    except ValueError as e:
        ap.error(str(e))
    tokenizer = None
    if a.model:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(a.model)
    rows = []
    for order, target in combos:
        for variant in a.variants.split(","):
            row = {"documents": order, "target": target, "variant": variant, "answer": docs[target]["answer"],
                   **ask(a.url.rstrip("/"), docs, order, target, variant, a.max_tokens)}
            ranges = row.get("kept_ranges")
            if tokenizer is not None and ranges:
                row["statement_kept"] = covered(ranges[order.index(target)],
                                                statement_span(tokenizer, docs[target]["text"]))
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "kept_ranges"}), flush=True)
            if a.out:
                with open(a.out, "w") as f:
                    json.dump({"url": a.url, "turn_words": a.turn_words, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
