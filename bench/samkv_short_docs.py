"""SamKV on short documents: is the planted fact in the kept context, and is the answer right?

Against one running ``--sparse samkv`` server (``--url``, 127.0.0.1 only). Every distinct RAG item of the soak
workload (:class:`bench.soak.Workload`: two documents of ``--doc-words`` words, one planted fact each, the question
about one of them), or with ``--docs N`` ``--items K`` K items of N documents (many short documents: the case
``min_middle_blocks`` routes; a fact planted in the asked one, or in every one with ``--distractors``), is asked four
ways: the documents API naming ``samkv`` (the sparsified, reused KV), naming
``recompute`` (the stock inline prompt through the API), naming no variant (the server's choice:
``min_document_tokens``, ``min_middle_blocks``), and the documents inlined in a plain chat request. For the ``samkv`` requests the
report's ``kept_ranges`` are decoded with the model's tokenizer to see whether the fact's sentence was kept.

    python -m bench.samkv_short_docs --url http://127.0.0.1:30000 --doc-words 300 --out DIR
    python -m bench.samkv_short_docs --url http://127.0.0.1:30000 --docs 24 --doc-words 120 --items 30 --out DIR
    python -m bench.samkv_short_docs --merge DIR1 DIR2 ... --out DIR    # one table of several runs' reports
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import requests

from bench.envinfo import collect
from bench.corpus import haystack
from bench.soak import SoakConfig, Workload, _doc

WAYS = ("samkv", "recompute", "default", "inline")


def items(doc_words: int, scan: int) -> list[dict]:
    """The distinct RAG items among the soak's first ``scan`` items."""
    wl, seen = Workload(SoakConfig(turn_words=doc_words)), {}
    for i in range(scan):
        it = wl.item(i)
        if it["kind"] == "rag":
            seen.setdefault((tuple(it["documents"]), it["question"], it["salt"]), it)
    return list(seen.values())


def many_doc_items(docs: int, doc_words: int, n_items: int, seed: int = 0, distractors: bool = False) -> list[dict]:
    """``n_items`` items of ``docs`` documents of ``doc_words`` words, the question about the fact planted in one of
    them (the others are plain text; with ``distractors`` each carries a fact of its own, about another locker); one
    salt for all (documents are not shared between items)."""
    out = []
    for i in range(n_items):
        rng = random.Random(f"{seed}-many-{docs}-{doc_words}-{int(distractors)}-{i}")
        ds, seen = [], set()
        while len(ds) < docs:
            d = _doc(rng, doc_words)
            if d["prefix"] not in seen:  # two documents about one locker would make the question ambiguous
                seen.add(d["prefix"])
                ds.append(d)
        j = rng.randrange(docs)
        target = ds[j]
        texts = [d["text"] if distractors or k == j else "\n\n".join(haystack(doc_words, rng))
                 for k, d in enumerate(ds)]
        out.append({"documents": texts, "question": target["question"], "answer": target["answer"],
                    "prefix": target["prefix"], "salt": "samkv-short-docs"})
    return out


def ask(url: str, it: dict, way: str) -> dict:
    question = "Use the documents to answer. " + it["question"]
    answer_turn = {"role": "assistant", "content": it["prefix"]}
    body = {"model": "default", "temperature": 0, "max_tokens": 12, "continue_final_message": True,
            "cache_salt": it["salt"]}
    if way == "inline":
        body["messages"] = [{"role": "user", "content": "\n\n".join(it["documents"]) + "\n\n" + question}, answer_turn]
    else:
        body.update(messages=[{"role": "user", "content": question}, answer_turn], documents=it["documents"])
        if way != "default":
            body["samkv"] = {"variant": way}
    r = requests.post(url + "/v1/chat/completions", json=body, timeout=900)
    r.raise_for_status()
    j = r.json()
    rep = (j.get("metadata") or {}).get("sparse") or {}
    return {"reply": j["choices"][0]["message"]["content"], "sparse": rep}


def fact_in_kept(tokenizer, it: dict, kept_ranges) -> bool | None:
    """Whether the answer's document kept the fact's sentence (its answer digits and subject), None without ranges."""
    if not kept_ranges:
        return None
    j = next(k for k, d in enumerate(it["documents"]) if it["answer"] in d)
    ids = tokenizer(it["documents"][j], add_special_tokens=False)["input_ids"]
    rng = kept_ranges[j]
    text = tokenizer.decode([t for a, b in zip(rng[::2], rng[1::2]) for t in ids[a:b]])
    subject = it["prefix"].rsplit(" locker", 1)[0].rsplit(" ", 2)[-2:]
    return it["answer"] in text and " ".join(subject) in text


def merge(dirs: list[str], out: Path, model: str = "SmolLM2-135M-Instruct") -> dict:
    """One report (``out``/samkv_many_short_docs.{json,md}) of several runs' ``samkv_short_docs.json``, a row each."""
    runs = []
    for d in dirs:
        j = json.loads((Path(d) / "samkv_short_docs.json").read_text())
        rows, sm = j["rows"], j["summary"]
        # a report without the field came from --docs before --distractors existed: a fact in every document
        distractors = bool(j.get("distractors", True))
        cmd = j["env"].get("command") or ""
        if distractors and "--distractors" not in cmd:
            cmd += "  # a fact in every document: today's --distractors"
        runs.append({"docs": j.get("docs", 2), "doc_words": j["doc_words"], "distractors": distractors,
                     "items": sm["items"], "right": {w: sm[w] for w in WAYS},
                     "default_recompute": sum(r["default"]["variant"] == "recompute" for r in rows),
                     "samkv_fact_kept": sm["samkv_fact_kept"], "samkv_assembled": sm["samkv_assembled"],
                     "document_tokens_median": sorted(sm["document_tokens"])[len(sm["document_tokens"]) // 2]
                     if sm["document_tokens"] else None,
                     "command": cmd, "gpu": j["env"].get("gpu"),
                     "versions": j["env"].get("versions"), "date_utc": j["env"].get("date_utc"), "rows": rows})
    out.mkdir(parents=True, exist_ok=True)
    doc = {"runs": runs}
    (out / "samkv_many_short_docs.json").write_text(json.dumps(doc, indent=1) + "\n")
    md = ["# SamKV on many short documents: the samkv pipeline, the server's default and the dense prompt", "",
          f"- device: {', '.join(sorted({str(r['gpu']) for r in runs}))}",
          f"- versions: {'; '.join(sorted({str(r['versions']) for r in runs}))}",
          f"- server: `--sparse samkv` at its defaults (FlashInfer), model {model}; items: `python -m bench.samkv_short_docs --docs N "
          "--doc-words W --items 30` (a planted locker code, the question about it after the documents; "
          "`--distractors`: every document carries a code of its own)",
          "- ways: `samkv` names the variant (the sparsified, reused KV), `recompute` the stock inline prompt through "
          "the documents API, `default` names none (the server's choice: `min_document_tokens`, "
          "`min_middle_blocks`), `inline` is a plain chat request with the documents in it", "",
          "| documents x words | facts | doc tokens (median) | samkv | recompute | default | inline | default chose "
          "recompute | samkv kept the fact |",
          "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        n = r["items"]
        md.append(f"| {r['docs']} x {r['doc_words']} | {'one per document' if r['distractors'] else 'asked one only'} "
                  f"| {r['document_tokens_median']} | " + " | ".join(f"{r['right'][w]} / {n}" for w in WAYS)
                  + f" | {r['default_recompute']} / {n} | {r['samkv_fact_kept']} / {r['samkv_assembled']} |")
    md += ["", "Commands:", ""] + [f"    {r['command']}" for r in runs]
    (out / "samkv_many_short_docs.md").write_text("\n".join(md) + "\n")
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.samkv_short_docs", description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:30000")
    ap.add_argument("--model", default=str(Path(__file__).resolve().parents[1] / "models" / "SmolLM2-135M-Instruct"),
                    help="tokenizer folder (the served model's)")
    ap.add_argument("--doc-words", type=int, default=300)
    ap.add_argument("--scan", type=int, default=120, help="soak items scanned for distinct RAG items")
    ap.add_argument("--docs", type=int, default=0,
                    help="documents per item (0: the soak's RAG items, 2 documents each); > 0 builds --items items")
    ap.add_argument("--items", type=int, default=30, help="items with --docs")
    ap.add_argument("--distractors", action="store_true",
                    help="with --docs: every document carries a fact about its own locker (default: only the asked one)")
    ap.add_argument("--merge", nargs="+", metavar="DIR", help="merge these runs' reports into --out (no server)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if a.merge:
        merge(a.merge, Path(a.out), Path(a.model).name)
        return 0
    if not a.url.startswith("http://127.0.0.1:"):
        ap.error("--url: only http://127.0.0.1:PORT")
    for name, lo in (("doc_words", 1), ("docs", 0), ("items", 1), ("scan", 1)):
        if getattr(a, name) < lo:
            ap.error(f"--{name.replace('_', '-')}: {getattr(a, name)} must be >= {lo}")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.model)
    rows = []
    todo = many_doc_items(a.docs, a.doc_words, a.items, distractors=a.distractors) if a.docs else items(a.doc_words, a.scan)
    for n, it in enumerate(todo):
        row = {"answer": it["answer"], "salt": it["salt"]}
        for way in WAYS:
            got = ask(a.url, it, way)
            rep = got["sparse"]
            row[way] = {"right": it["answer"] in got["reply"], "reply": got["reply"][:60],
                        "status": rep.get("scheduler_status"), "variant": rep.get("variant"),
                        "document_tokens": rep.get("document_tokens"), "kv_kept_ratio": rep.get("kv_kept_ratio"),
                        "variant_reason": rep.get("variant_reason"),
                        "fact_kept": fact_in_kept(tok, it, rep.get("kept_ranges")) if way == "samkv" else None}
        rows.append(row)
        print(f"[{n + 1}/{len(todo)}] " + json.dumps({w: row[w]["right"] for w in WAYS}), file=sys.stderr, flush=True)
    assembled = [r for r in rows if r["samkv"]["status"] == "assembled"]
    summary = {w: sum(r[w]["right"] for r in rows) for w in WAYS}
    n_docs = a.docs or 2
    summary.update(items=len(rows), docs_per_item=n_docs, samkv_assembled=len(assembled),
                   default_variants=sorted({str(r["default"]["variant"]) for r in rows}),
                   default_reasons=sorted({str(r["default"]["variant_reason"]) for r in rows}),
                   samkv_fact_kept=sum(bool(r["samkv"]["fact_kept"]) for r in assembled),
                   samkv_right_when_fact_dropped=sum(r["samkv"]["right"] for r in assembled
                                                     if not r["samkv"]["fact_kept"]),
                   document_tokens=sorted({r["samkv"]["document_tokens"] for r in rows} - {None}))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    env = collect(sys.executable, ["python", "-m", "bench.samkv_short_docs",
                                   *(argv if argv is not None else sys.argv[1:])])
    (out / "samkv_short_docs.json").write_text(json.dumps({"env": env, "doc_words": a.doc_words, "docs": n_docs,
                                                           "distractors": bool(a.distractors or not a.docs),
                                                           "summary": summary, "rows": rows}, indent=1) + "\n")
    what = (f"{len(rows)} items of {n_docs} documents, " + ("a fact in each" if a.distractors else "one with a fact")
            if a.docs else "the soak's RAG items")
    md = [f"# SamKV on short documents ({what})", "",
          f"- command: `{env.get('command')}`", f"- device: {env['gpu']}; machine: {env['machine']}",
          f"- versions: {env.get('versions')}", f"- documents: {n_docs} x {a.doc_words} words, "
          + ("one planted fact each" if a.distractors or not a.docs else "a planted fact in the asked one only") + "; "
          f"document tokens per item: {summary['document_tokens']}",
          f"- the server's choice (`default`): variants {summary['default_variants']}, reasons "
          f"{summary['default_reasons']}", "",
          "| way | right |", "|---|---|"]
    md += [f"| {w} | {summary[w]} / {len(rows)} |" for w in WAYS]
    md += ["", f"`samkv` assembled {len(assembled)} of {len(rows)} (the others fell back densely: documents evicted "
           f"from the server's pool); the fact's sentence was in the kept context in {summary['samkv_fact_kept']} of "
           f"them; right where it was dropped: {summary['samkv_right_when_fact_dropped']}."]
    (out / "samkv_short_docs.md").write_text("\n".join(md) + "\n")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
