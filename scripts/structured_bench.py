"""JSON-schema extraction through the server, as applications use it: the real ``openai`` client
against ``specdecode serve``'s app on loopback, the default model, greedy.

Each request asks for JSON extracted from one text of the development half of Spec-Bench
(summarization articles, RAG passages, QA questions) under one of several schemas (flat strings,
enums and booleans, arrays, nested objects, numbers). Every method answers every request; the
script checks that every output validates against its schema (``jsonschema``) and that every
method's tokens equal ``ar``'s, and reports each method's speed over ``ar`` under the same
schemas (wall time per request through the server, and tokens per target forward), with the
tokens the grammar forced (jump-forward) and the draft nodes it pruned. The reference is
``ar:nojf``: plain decoding under the grammar, every token through a target forward; ``ar``
alone is plain decoding with jump-forward.

    python scripts/structured_bench.py --requests 24 --out docs/results/structured.json

Requests of all methods are interleaved (request i by every method, then i + 1), so a machine's
changing load falls on all of them alike. docs/structured-output.md reports the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

DEV = Path(__file__).resolve().parents[1] / "src" / "specdecode" / "data" / "spec_bench_dev.jsonl"

SCHEMAS = {
    "summary": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 80},
            "summary": {"type": "string", "maxLength": 300},
            "keywords": {"type": "array", "items": {"type": "string", "maxLength": 30},
                         "minItems": 1, "maxItems": 5},
        },
        "required": ["title", "summary", "keywords"], "additionalProperties": False,
    },
    "entities": {
        "type": "object",
        "properties": {
            "people": {"type": "array", "items": {"type": "string", "maxLength": 40},
                       "maxItems": 5},
            "places": {"type": "array", "items": {"type": "string", "maxLength": 40},
                       "maxItems": 5},
            "organizations": {"type": "array", "items": {"type": "string", "maxLength": 40},
                              "maxItems": 5},
        },
        "required": ["people", "places", "organizations"], "additionalProperties": False,
    },
    "classification": {
        "type": "object",
        "properties": {
            "topic": {"enum": ["politics", "business", "science", "sports", "health",
                               "entertainment", "technology", "other"]},
            "sentiment": {"enum": ["positive", "negative", "neutral"]},
            "is_question": {"type": "boolean"},
            "language": {"type": "string", "maxLength": 20},
        },
        "required": ["topic", "sentiment", "is_question", "language"],
        "additionalProperties": False,
    },
    "facts": {
        "type": "object",
        "properties": {
            "facts": {
                "type": "array", "minItems": 1, "maxItems": 4,
                "items": {
                    "type": "object",
                    "properties": {"subject": {"type": "string", "maxLength": 40},
                                   "detail": {"type": "string", "maxLength": 100},
                                   "year": {"type": ["integer", "null"]}},
                    "required": ["subject", "detail", "year"], "additionalProperties": False,
                },
            },
        },
        "required": ["facts"], "additionalProperties": False,
    },
    "answer": {
        "type": "object",
        "properties": {
            "question": {"type": "string", "maxLength": 200},
            "answer": {"type": "string", "maxLength": 200},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["question", "answer", "confidence"], "additionalProperties": False,
    },
}


def texts(n: int, max_chars: int) -> list[str]:
    """``n`` texts from the dev half's summarization, RAG and QA questions, in turn."""
    by_task: dict[str, list[str]] = {"summarization": [], "rag": [], "qa": []}
    for line in DEV.read_text().splitlines():
        q = json.loads(line)
        if q["category"] in by_task:
            by_task[q["category"]].append(q["turns"][0][:max_chars])
    out = []
    for i in range(n):
        task = list(by_task)[i % len(by_task)]
        out.append(by_task[task][(i // len(by_task)) % len(by_task[task])])
    return out


def requests(n: int, max_chars: int) -> list[tuple[str, str]]:
    """(schema name, user message) pairs; the schema is in the prompt too, as applications
    usually write it."""
    names = list(SCHEMAS)
    out = []
    for i, text in enumerate(texts(n, max_chars)):
        name = names[i % len(names)]
        out.append((name, f"Extract the information from the text below as JSON with this "
                          f"schema:\n{json.dumps(SCHEMAS[name])}\n\nText:\n{text}"))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--methods", default="ar:nojf,ar,suffix",
                        help="comma-separated; the first is the reference; ':nojf' turns "
                             "jump-forward off (ar:nojf is plain decoding under the grammar); "
                             "the default method is added when missing")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--max-chars", type=int, default=1500,
                        help="characters of each text put in the prompt")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--runner", default="auto")
    parser.add_argument("--out", default=None, help="write the per-request results here (JSON)")
    args = parser.parse_args(argv)

    import jsonschema
    import openai

    from specdecode import registry
    from specdecode.api import eos_ids
    from specdecode.models.loading import load_model, make_runner
    from specdecode.server import BackgroundServer
    from specdecode.server.app import Server, Settings, create_app

    methods = args.methods.split(",")
    if registry.DEFAULT_METHOD not in methods:
        methods.append(registry.DEFAULT_METHOD)
    loaded = load_model(args.model)
    runner = make_runner(loaded, args.runner)
    server = Server([runner], loaded.tokenizer, eos_ids(loaded, loaded.tokenizer),
                    Settings(model_id="m", default_max_tokens=args.max_tokens))
    runner.prefill(server.encode("Hello", chat=True))  # one-off costs out of the timings
    work = requests(args.requests, args.max_chars)
    rows = []
    with BackgroundServer(create_app(server)) as background:
        client = openai.OpenAI(base_url=background.url + "/v1", api_key="none",
                               max_retries=0, timeout=600)
        for i, (name, message) in enumerate(work):
            row = {"request": i, "schema": name, "methods": {}}
            for variant in methods:
                method, _, flag = variant.partition(":")
                t0 = time.perf_counter()
                out = client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": message}],
                    max_tokens=args.max_tokens, temperature=0,
                    response_format={"type": "json_schema", "json_schema": {
                        "name": name, "schema": SCHEMAS[name], "strict": True}},
                    extra_body={"specdecode": {"method": method, "return_token_ids": True,
                                               "jump_forward": flag != "nojf"}})
                seconds = time.perf_counter() - t0
                choice, usage = out.choices[0], out.usage.model_extra
                valid = None
                if choice.finish_reason == "stop":
                    try:
                        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])
                        valid = True
                    except (ValueError, jsonschema.ValidationError):
                        valid = False
                row["methods"][variant] = {
                    "seconds": round(seconds, 4), "finish_reason": choice.finish_reason,
                    "valid": valid, "tokens": out.usage.completion_tokens,
                    "target_forwards": usage["target_forwards"],
                    "forced_tokens": usage.get("forced_tokens"),
                    "pruned_nodes": usage.get("pruned_nodes"),
                    "token_ids": choice.model_extra["token_ids"],
                    "text": choice.message.content}
            ref = row["methods"][methods[0]]["token_ids"]
            row["identical"] = all(m["token_ids"] == ref for m in row["methods"].values())
            rows.append(row)
            print(json.dumps({"request": i, "schema": name, "identical": row["identical"],
                              **{m: [r["seconds"], r["tokens"], r["valid"]]
                                 for m, r in row["methods"].items()}}), flush=True)
    report = summary(rows, methods)
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps({"summary": report, "requests": rows,
                                              "load": os.getloadavg()}, indent=1))
    ok = report["all_valid"] and report["all_identical"]
    return 0 if ok else 1


def summary(rows: list[dict], methods: list[str]) -> dict:
    reference = methods[0]
    out = {"requests": len(rows),
           "all_identical": all(r["identical"] for r in rows),
           "all_valid": all(m["valid"] is not False for r in rows for m in r["methods"].values()),
           "finished": sum(r["methods"][reference]["finish_reason"] == "stop" for r in rows),
           "load_average": [round(x, 2) for x in os.getloadavg()],
           "methods": {}}
    base = sum(r["methods"][reference]["seconds"] for r in rows)
    for method in methods:
        runs = [r["methods"][method] for r in rows]
        seconds = sum(m["seconds"] for m in runs)
        tokens = sum(m["tokens"] for m in runs)
        out["methods"][method] = {
            "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 2) if seconds else 0.0,
            "speedup_over_" + reference: round(base / seconds, 3) if seconds else 0.0,
            "tokens_per_forward": round(tokens / max(1, sum(m["target_forwards"] for m in runs)),
                                        3),
            "forced_tokens": sum(m["forced_tokens"] or 0 for m in runs),
            "pruned_nodes": sum(m["pruned_nodes"] or 0 for m in runs),
        }
    return out


if __name__ == "__main__":
    sys.exit(main())
