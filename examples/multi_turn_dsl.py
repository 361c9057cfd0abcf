"""A multi-turn SGLang frontend-DSL program against an sglang-sparse server.

    python examples/multi_turn_dsl.py [--url http://127.0.0.1:30000]

Each turn extends the conversation, so its prompt starts with the previous turns: the server
serves that prefix from the radix cache (printed as cached tokens per turn).
"""

from __future__ import annotations

import argparse
import sys

import sglang as sgl

QUESTIONS = [
    "My name is Ada and I live in Lyon. Please remember both.",
    "Which city do I live in?",
    "And what is my name?",
]


@sgl.function
def conversation(s, questions):
    s += sgl.system("You are a helpful assistant. Answer briefly.")
    for i, q in enumerate(questions):
        s += sgl.user(q)
        s += sgl.assistant(sgl.gen(f"answer_{i}", max_tokens=48, temperature=0))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:30000")
    a = ap.parse_args()
    backend = sgl.RuntimeEndpoint(a.url, chat_template_name="chatml")
    state = conversation.run(questions=QUESTIONS, backend=backend)
    for i, q in enumerate(QUESTIONS):
        meta = state.get_meta_info(f"answer_{i}")
        print(f"turn {i + 1}: {q}\n  -> {state[f'answer_{i}']!r}  "
              f"(prompt {meta['prompt_tokens']} tokens, {meta['cached_tokens']} from the radix cache)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
