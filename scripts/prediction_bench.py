"""What OpenAI's Predicted Outputs (``prediction``) give a running server: each question is
answered by ``ar``, then ``--repeats`` times by ``suffix`` without a prediction, then
``--repeats`` times by ``suffix`` with the ``ar`` answer as its prediction (an answer to
regenerate: text the prompt does not hold). Every answer must be ``ar``'s tokens. Printed: the
seconds of each (medians without; the first and the last with a prediction: a method's draft
sizing starts from its acceptance on the requests before, so the first request with a
prediction after requests without one drafts short until its own acceptance shows) and its
target forwards.

    specdecode serve --model qwen2.5-coder-1.5b --method suffix -c max_cached_requests=0 \\
        --parallel 1 --port 8311 &
    python scripts/prediction_bench.py --url http://127.0.0.1:8311 --model qwen2.5-coder-1.5b

(``--predicted-only``, on a fresh server: only requests with a prediction.)
``max_cached_requests=0`` turns off suffix's tree of earlier answers, which would otherwise
draft a repeated question's answer without any prediction.
"""

from __future__ import annotations

import argparse
import statistics
import time

import httpx

QUESTIONS = [
    "Write a Python function that checks whether a number is prime, with a docstring.",
    "Write a Python class for a stack with push, pop, peek and is_empty, with docstrings.",
    "Explain in a few sentences how a hash table handles collisions.",
]


def ask(url: str, model: str, question: str, method: str, max_tokens: int,
        prediction: str | None = None) -> tuple[dict, float]:
    body = {"model": model, "messages": [{"role": "user", "content": question}],
            "max_tokens": max_tokens, "specdecode": {"method": method, "return_token_ids": True}}
    if prediction is not None:
        body["prediction"] = {"type": "content", "content": prediction}
    start = time.perf_counter()
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    response.raise_for_status()
    return response.json(), time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8311")
    parser.add_argument("--model", required=True, help="the served model's name")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--predicted-only", action="store_true",
                        help="no requests without a prediction (their low acceptance is what "
                             "the method's draft sizing starts the next request from)")
    args = parser.parse_args()
    print("| question | tokens | ar s | suffix s (forwards) | suffix + prediction, first s "
          "(forwards) | last s (forwards) |")
    print("|---|---:|---:|---:|---:|---:|")
    for i, question in enumerate(QUESTIONS):
        reference, ar_s = ask(args.url, args.model, question, "ar", args.max_tokens)
        text = reference["choices"][0]["message"]["content"]
        runs = {None: [], text: []}
        for prediction in ((text,) if args.predicted_only else (None, text)):
            for _ in range(args.repeats):
                out, seconds = ask(args.url, args.model, question, "suffix", args.max_tokens,
                                   prediction)
                if out["choices"][0]["token_ids"] != reference["choices"][0]["token_ids"]:
                    raise SystemExit(f"question {i}: an answer differs from ar's")
                runs[prediction].append((seconds, out["usage"]["target_forwards"]))
        plain, predicted = runs[None], runs[text]
        median = (f"{statistics.median(s for s, _ in plain):.2f} "
                  f"({statistics.median(f for _, f in plain):.0f})" if plain else "-")
        first, last = (f"{s:.2f} ({f})" for s, f in (predicted[0], predicted[-1]))
        tokens = reference["usage"]["completion_tokens"]
        print(f"| {i} | {tokens} | {ar_s:.2f} | {median} | {first} | {last} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
