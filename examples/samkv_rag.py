"""RAG over cached documents with a `--sparse samkv` server (OpenAI client + DSL helper).

    python -m sglang.launch_server --model-path models/SmolLM2-135M-Instruct --device cpu --sparse samkv
    python examples/samkv_rag.py [--url http://127.0.0.1:30000]

The first request prefills each document alone and caches it (per `cache_salt`); the second asks
another question over the same documents: only the question is computed (see `metadata.sparse`).
"""

from __future__ import annotations

import argparse
import json
import sys

import requests
from openai import OpenAI

DOCS = [
    "The lighthouse keeper logged every ship that passed the northern cape. In the winter of 1891 he "
    "counted forty-two schooners and a single steamer.",
    "Alice's secret number is 4817. She wrote it on the inside cover of her notebook.",
    "Bruno prefers green tea to coffee and walks along the river every morning.",
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:30000")
    a = ap.parse_args()
    try:
        requests.get(a.url + "/health", timeout=5).raise_for_status()
    except requests.RequestException as e:
        print(f"server at {a.url} unreachable: {e}", file=sys.stderr)
        return 1
    client = OpenAI(base_url=a.url + "/v1", api_key="none")
    for q in ("What is Alice's secret number?", "How many schooners did the keeper count in 1891?"):
        r = client.chat.completions.create(model="default", messages=[{"role": "user", "content": q}],
                                           max_tokens=24, temperature=0,
                                           extra_body={"documents": DOCS, "cache_salt": "example"})
        print(q, "->", r.choices[0].message.content)
        print("   ", json.dumps((r.model_extra.get("metadata") or {}).get("sparse")))

    import sglang as sgl

    from sglang_sparse.samkv.dsl import gen_with_documents

    @sgl.function
    def qa(s, question):
        s += f"Question: {question}\nAnswer:"
        gen_with_documents(s, "answer", DOCS, max_tokens=16, cache_salt="example")

    state = qa.run(question="What does Bruno drink?", backend=sgl.RuntimeEndpoint(a.url))
    print("DSL ->", state["answer"].strip(), state.get_var("answer_sparse")["documents_reused"], "documents reused")
    return 0


if __name__ == "__main__":
    sys.exit(main())
