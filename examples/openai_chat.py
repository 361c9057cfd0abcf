"""Chat with an sglang-sparse server through the OpenAI client: one plain and one streaming request.

    python examples/openai_chat.py [--url http://127.0.0.1:30000] [--prompt "..."]

Start the server first (README). Exits non-zero if the server is unreachable.
"""

from __future__ import annotations

import argparse
import sys

import requests
from openai import OpenAI


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:30000")
    ap.add_argument("--prompt", default="What is the capital of France?")
    ap.add_argument("--max-tokens", type=int, default=64)
    a = ap.parse_args()

    info = requests.get(a.url + "/server_info", timeout=30).json()
    print(f"server: sglang {info.get('version')} --sparse {info.get('sparse')} config {info.get('sparse_config')}")

    client = OpenAI(base_url=a.url + "/v1", api_key="none", timeout=120)
    messages = [{"role": "user", "content": a.prompt}]
    r = client.chat.completions.create(model="default", messages=messages, max_tokens=a.max_tokens, temperature=0)
    print(f"plain:     {r.choices[0].message.content!r} ({r.usage.prompt_tokens} prompt / "
          f"{r.usage.completion_tokens} completion tokens)")

    print("streaming: ", end="", flush=True)
    for chunk in client.chat.completions.create(model="default", messages=messages, max_tokens=a.max_tokens,
                                                temperature=0, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
