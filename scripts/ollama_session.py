"""A code-editing chat through Ollama's API, as an Ollama client holds it: the official
``ollama`` library sends every turn with the whole conversation before it (``/api/chat``), with
Ollama's default sampling (temperature 0.8, top-k 40, top-p 0.9, repeat penalty 1.1 over the
last 64 tokens) seeded by the turn, at most ``--max-tokens`` tokens a turn. The first turn gives
a function of the standard library (``textwrap.dedent``) to edit; the next ones ask for more
edits of the answer. Each method holds the whole chat on a server of its own (started here, so
that no method reads rows another one cached). Printed: per method and turn, seconds, the
prompt tokens read (those the prompt cache held left out, as Ollama counts them), tokens
written, and whether the answer is the first method's.

    python scripts/ollama_session.py --model qwen2.5-coder-1.5b --methods ar,suffix
"""

from __future__ import annotations

import argparse
import inspect
import textwrap
import time

import ollama

from infill_session import serve

TURNS = ("Add type hints to this function and return the whole function:\n\n{code}",
         "Now add a docstring in Google style and return the whole function.",
         "Rename the variable margin to common_prefix and return the whole function.")


def chat(url: str, model: str, turns: int, max_tokens: int) -> list[dict]:
    client = ollama.Client(host=url, timeout=1200)
    messages, out = [], []
    code = inspect.getsource(textwrap.dedent)
    for turn in range(turns):
        messages.append({"role": "user", "content": TURNS[turn].format(code=code)})
        started = time.perf_counter()
        reply = client.chat(model=model, messages=messages,
                            options={"seed": turn, "num_predict": max_tokens})
        seconds = time.perf_counter() - started
        messages.append({"role": "assistant", "content": reply.message.content})
        out.append({"seconds": seconds, "read": reply.prompt_eval_count,
                    "written": reply.eval_count, "text": reply.message.content})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--methods", default="ar,suffix")
    parser.add_argument("--turns", type=int, default=len(TURNS), choices=range(1, len(TURNS) + 1))
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--port", type=int, default=8013)
    args = parser.parse_args()
    first = None
    for method in args.methods.split(","):
        server = serve(args.model, args.port)
        try:
            rows = chat(f"http://127.0.0.1:{args.port}", f"{args.model}+{method}", args.turns,
                        args.max_tokens)
        finally:
            server.terminate()
            server.wait()
        first = first or rows
        for turn, (row, reference) in enumerate(zip(rows, first), 1):
            print(f"{method} turn {turn}: {row['seconds']:.2f} s, read {row['read']} prompt "
                  f"tokens, wrote {row['written']} ({row['written'] / row['seconds']:.1f} a "
                  f"second overall); the first method's answer: {row['text'] == reference['text']}",
                  flush=True)
        total = sum(row["seconds"] for row in rows)
        print(f"{method}: {total:.1f} s in all", flush=True)


if __name__ == "__main__":
    main()
