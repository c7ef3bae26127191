"""What scoring a prompt costs on a running server: each of the first ``--articles``
summarisation articles of the Spec-Bench dev half, cut to ``--tokens`` tokens, sent twice in
turn: as a plain completion of one token (the prompt prefilled) and with ``echo``,
``logprobs: 1`` and ``max_tokens: 0`` (the prompt read as scored verify chains, the LM head on
every row). The plain request goes first, so the echo reuses no cached rows either way.

    specdecode serve --model qwen2.5-coder-1.5b --port 8000 &
    python scripts/echo_bench.py --url http://127.0.0.1:8000 --model qwen2.5-coder-1.5b
"""

from __future__ import annotations

import argparse
import statistics
import time

import httpx

from specdecode.bench.perplexity import article_texts
from specdecode.questions import load_questions


def timed(client: httpx.Client, url: str, body: dict) -> tuple[float, dict]:
    started = time.perf_counter()
    response = client.post(url + "/v1/completions", json=body)
    response.raise_for_status()
    return time.perf_counter() - started, response.json()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="default")
    parser.add_argument("--articles", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=512)
    args = parser.parse_args()
    texts = article_texts(load_questions())[:args.articles]
    plain_s, echo_s, counts = [], [], []
    with httpx.Client(timeout=3600) as client:
        for text in texts:
            ids = client.post(args.url + "/tokenize", json={"prompt": text}).json()["tokens"]
            ids = ids[:args.tokens]
            counts.append(len(ids))
            seconds, _ = timed(client, args.url, {"model": args.model, "prompt": ids,
                                                  "max_tokens": 1})
            plain_s.append(seconds)
            seconds, body = timed(client, args.url, {"model": args.model, "prompt": ids,
                                                     "max_tokens": 0, "echo": True,
                                                     "logprobs": 1})
            echo_s.append(seconds)
            scored = body["choices"][0]["logprobs"]["token_logprobs"][1:]
            print(f"{len(ids)} tokens: prefill {plain_s[-1]:.2f} s, scored {seconds:.2f} s, "
                  f"mean log-probability {sum(scored) / len(scored):.3f}", flush=True)
    ratio = statistics.median(e / p for e, p in zip(echo_s, plain_s))
    print(f"{len(texts)} prompts, {sum(counts)} tokens: prefilled at "
          f"{sum(counts) / sum(plain_s):.0f} tokens/s, scored at {sum(counts) / sum(echo_s):.0f} "
          f"tokens/s; scoring a prompt takes a median {ratio:.2f}x its prefill")


if __name__ == "__main__":
    main()
