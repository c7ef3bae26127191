"""Multi-turn serving: the time to first token of every turn of a conversation sent with its
whole history, by ``specdecode serve`` with its prompt cache and without it, beside llama.cpp's
``llama-server`` with its slot cache (``cache_prompt``) and without, on the same GGUF file and
threads, one slot each (ours with the cache a second, for the references below;
``scripts/multiturn_bench.py``; docs/server.md).

Each server runs every conversation of :mod:`.multiturn_workloads` in turn, streamed, greedy,
and each request is timed: time to first token (request sent to the first content or tool-call
delta), prompt tokens, the tokens its cache served (ours: ``usage.prompt_tokens_details
.cached_tokens``; llama-server: ``timings.cache_n``) and the whole request. Every server writes
its own answers, so histories differ between servers; ours with and without the cache must give
the same answers (the cache changes when, never what): a difference fails the run.

Besides the client's time to first token, each request's prompt seconds as the server reports
them (ours: ``usage.prompt_s``; llama-server: ``timings.prompt_ms``): a tool call's first
delta comes once the model has written the call's name, some tokens after the prompt is read.
A turn's reference: a request of only the tokens the cache did not hold (the last ``prompt -
cached`` token ids of the turn's prompt, one token asked for), sent right after the turn to the
same server, our server with the cache, which has a second slot for it (the reference shares
no prefix with the conversation, so it takes the emptier slot and the conversation's rows stay
where they are): what the turn's prompt would cost if its history were free, timed side by
side with the turn (a reference timed minutes later on another server process moves with
whatever the machine does meanwhile).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from specdecode.bench.multiturn_workloads import WORKLOADS, Conversation, conversations
from specdecode.bench.serving_servers import (LLAMA_SERVER, OURS, ServerProcess, ServerSpec,
                                              command, free_port, llama_server_binary)
from specdecode.errors import SpecDecodeError, require

#: the contenders: label -> (kind, extra arguments, llama-server's cache_prompt)
SERVERS = {
    "specdecode": (OURS, (), False),
    "specdecode-no-cache": (OURS, ("--prompt-cache-mb", "0"), False),
    "llama-server": (LLAMA_SERVER, (), True),
    "llama-server-no-cache": (LLAMA_SERVER, (), False),
}
CACHED, UNCACHED = "specdecode", "specdecode-no-cache"
REQUEST_TIMEOUT = 600.0


def stream_chat(client: httpx.Client, url: str, model: str, messages: list[dict],
                tools: list[dict] | None, max_tokens: int, tool_choice: str = "auto") -> dict:
    """One streamed greedy chat request: its timings, text, tool calls and token counts
    (``client``: one for every request; making one costs tens of milliseconds, its TLS
    context, which the time to first token would count)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    if tools:
        body.update(tools=tools, tool_choice=tool_choice)
    text, calls, usage, timings, first = [], {}, {}, {}, None
    start = time.perf_counter()
    with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:  # (reading the body waits for the whole stream)
            raise SpecDecodeError(f"{url} answered {response.status_code}: "
                                  f"{response.read()[:300]!r}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
            for choice in chunk.get("choices", []):
                delta = choice.get("delta", {})
                if first is None and (delta.get("content") or delta.get("tool_calls")):
                    first = time.perf_counter() - start
                text.append(delta.get("content") or "")
                for call in delta.get("tool_calls") or []:
                    entry = calls.setdefault(call["index"], {"id": "", "name": "", "arguments": ""})
                    entry["id"] = call.get("id") or entry["id"]
                    function = call.get("function") or {}
                    entry["name"] += function.get("name") or ""
                    entry["arguments"] += function.get("arguments") or ""
    return {"ttft_s": first if first is not None else time.perf_counter() - start,
            "total_s": time.perf_counter() - start, "text": "".join(text),
            "tool_calls": [calls[i] for i in sorted(calls)], **prompt_counts(usage, timings)}


def prompt_counts(usage: dict, timings: dict) -> dict:
    """Prompt tokens, the tokens the server's cache served and its prompt seconds: ours from
    ``usage``, llama-server's from its ``timings``."""
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", timings.get("cache_n"))
    seconds = usage.get("prompt_s")
    if seconds is None and "prompt_ms" in timings:
        seconds = timings["prompt_ms"] / 1000
    return {"prompt_tokens": usage.get("prompt_tokens"), "cached_tokens": cached,
            "prompt_s": seconds}


def assistant_message(answer: dict) -> dict:
    """The answer as the next request's history holds it."""
    message = {"role": "assistant", "content": answer["text"] or None}
    if answer["tool_calls"]:
        message["tool_calls"] = [
            {"id": call["id"] or f"call_{i}", "type": "function",
             "function": {"name": call["name"], "arguments": call["arguments"]}}
            for i, call in enumerate(answer["tool_calls"])]
    return message


def run_conversation(client: httpx.Client, url: str, model: str, conversation: Conversation,
                     max_tokens: int, rounds: int,
                     after: Callable[[dict], None] | None = None) -> list[dict]:
    """Every turn of ``conversation`` with its whole history (tool calls carried out, at most
    ``rounds`` requests a turn: the first must call a tool, as an agent's step does, the next
    may answer in text); one record per request, each given to ``after`` as it is made."""
    messages = [{"role": "system", "content": conversation.system}] if conversation.system else []
    records = []
    for turn, content in enumerate(conversation.turns):
        messages.append({"role": "user", "content": content})
        for round_ in range(rounds):
            sent = list(messages)
            answer = stream_chat(client, url, model, sent, conversation.tools, max_tokens,
                                 "required" if round_ == 0 else "auto")
            records.append({"workload": conversation.workload, "conversation": conversation.name,
                            "turn": turn, "request": len(records), "messages": sent, **answer})
            if after is not None:
                after(records[-1])
            messages.append(assistant_message(answer))
            if not answer["tool_calls"]:
                break
            for call, sent_call in zip(answer["tool_calls"], messages[-1]["tool_calls"]):
                messages.append({"role": "tool", "tool_call_id": sent_call["id"],
                                 "content": conversation.run_tool(call["name"], call["arguments"])})
    return records


def reference_prompt_s(client: httpx.Client, url: str, model: str, ids: list[int]) -> float:
    """The server's prompt seconds of a raw completion of ``ids`` (one token asked for)."""
    body = {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0}
    response = client.post(url + "/v1/completions", json=body)
    require(response.status_code == 200, f"{url} answered {response.status_code} to a reference")
    return response.json()["usage"]["prompt_s"]


def prompt_ids(tokenizer, model: str, messages: list[dict], tools: list[dict] | None) -> list[int]:
    """The token ids our server makes of a chat request (its own parsing and chat template)."""
    from specdecode.api import encode_prompt
    from specdecode.server.protocol import ChatRequest, parse

    req = parse(ChatRequest, {"model": model, "messages": messages,
                              **({"tools": tools} if tools else {})})
    offered = req.tool_request.offered if req.tool_request is not None else None
    return encode_prompt(tokenizer, [m.as_template_input() for m in req.messages], True, offered)


def add_reference(client: httpx.Client, url: str, model: str, tokenizer, record: dict,
                  tools: list[dict] | None) -> None:
    """The record's reference: its new tokens alone, on the server at ``url``; ``tools``: its
    conversation's."""
    ids = prompt_ids(tokenizer, model, record["messages"], tools)
    require(len(ids) == record["prompt_tokens"],
            f"the bench's prompt has {len(ids)} tokens, the server's {record['prompt_tokens']}")
    new = len(ids) - (record["cached_tokens"] or 0)
    record["new_tokens"] = new
    record["reference_prompt_s"] = reference_prompt_s(client, url, model, ids[-new:])


def run_server(label: str, args: argparse.Namespace, chats: list[Conversation], paths: dict,
               tokenizer=None) -> list[dict]:
    """Every conversation on a fresh server ``label`` (a warm-up request first, untimed);
    ``tokenizer``: time each request's reference right after it, on a second slot."""
    kind, extra, cache_prompt = SERVERS[label]
    port = free_port()
    argv = command(ServerSpec(kind, args.method if kind == OURS else None, extra), port,
                   1 if tokenizer is None else 2, args.context, args.threads, args.model,
                   paths["gguf"], paths["llama"], cache_prompt=cache_prompt)
    # one client for every request (making one costs tens of milliseconds, its TLS context),
    # a new connection each (llama-server closes one after a streamed response without saying
    # so, and a request sent on it fails: every second one)
    with ServerProcess(argv, port, args.threads, paths["log"]) as server, \
            httpx.Client(timeout=REQUEST_TIMEOUT,
                         limits=httpx.Limits(max_keepalive_connections=0)) as client:
        model = server.model_name()
        stream_chat(client, server.url, model, [{"role": "user", "content": "Hello"}], None, 8)
        records = []
        for chat in chats:
            fresh = dataclasses.replace(chat, files=dict(chat.files))  # its edits its own
            after = None if tokenizer is None else (
                lambda record, tools=chat.tools: add_reference(client, server.url, model,
                                                               tokenizer, record, tools))
            done = run_conversation(client, server.url, model, fresh, args.max_tokens,
                                    args.rounds, after)
            print(f"{label} | {chat.name} | prompt s, ttft s, cached tokens: " + ", ".join(
                f"{r['prompt_s'] or 0:.2f} {r['ttft_s']:.2f} {r['cached_tokens']}" for r in done),
                flush=True)
            records += done
    for record in records:
        record["server"] = label
    return records


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summary(records: list[dict]) -> list[dict]:
    """Per server and workload: requests, median prompt and cached tokens, median time to
    first token of the first turn and of the later ones, and whole time."""
    rows = []
    for server in dict.fromkeys(r["server"] for r in records):
        for workload in dict.fromkeys(r["workload"] for r in records):
            mine = [r for r in records if r["server"] == server and r["workload"] == workload]
            later = [r for r in mine if r["request"] > 0]
            rows.append({
                "server": server, "workload": workload, "requests": len(mine),
                "prompt_tokens": median([r["prompt_tokens"] or 0 for r in mine]),
                "cached_share": (sum(r["cached_tokens"] or 0 for r in later) /
                                 max(1, sum(r["prompt_tokens"] or 0 for r in later))),
                "first_ttft_s": median([r["ttft_s"] for r in mine if r["request"] == 0]),
                "later_ttft_s": median([r["ttft_s"] for r in later]),
                "later_prompt_s": median([r["prompt_s"] for r in later if r["prompt_s"] is not None]),
                "total_s": sum(r["total_s"] for r in mine)})
    return rows


def markdown(meta: dict, records: list[dict], mismatches: list[str]) -> str:
    def cell(value, fmt="{:.2f}"):
        return "-" if value is None else fmt.format(value)

    lines = ["# Multi-turn serving: time to first token with and without a prompt cache", "",
             f"Model `{meta['model']}`, {meta['threads']} threads, one slot each (ours with "
             f"the cache a second, for the references), greedy, "
             f"`--max-tokens {meta['max_tokens']}`; machine: {meta['cpu']}. Command: "
             f"`{meta['command']}`.", "",
             "| server | workload | requests | median prompt tokens | cached share (turns after "
             "the first) | TTFT first turn s | median TTFT later turns s | median prompt s later "
             "turns | whole run s |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in summary(records):
        lines.append(f"| {row['server']} | {row['workload']} | {row['requests']} | "
                     f"{cell(row['prompt_tokens'], '{:.0f}')} | {row['cached_share']:.0%} | "
                     f"{cell(row['first_ttft_s'])} | {cell(row['later_ttft_s'])} | "
                     f"{cell(row['later_prompt_s'])} | {row['total_s']:.1f} |")
    ratios = [r["prompt_s"] / r["reference_prompt_s"] for r in records
              if r["server"] == CACHED and r["request"] > 0 and r.get("reference_prompt_s")]
    if ratios:
        lines += ["", f"Our cached turns against a request of only their new tokens (the "
                      f"turn's prompt seconds over the reference's, timed right after it on "
                      f"the same server's second slot; turns after the first, "
                      f"{len(ratios)} requests): median {statistics.median(ratios):.2f}x, worst "
                      f"{max(ratios):.2f}x."]
    lines += ["", "Answers with and without our prompt cache: " +
              ("identical on every request." if not mismatches else
               f"**{len(mismatches)} differ**: " + "; ".join(mismatches))]
    return "\n".join(lines) + "\n"


def compare_answers(records: list[dict]) -> list[str]:
    """Requests whose answer differs between our server with and without the cache."""
    def answer(r):  # tool call ids are the server's own random names
        return r["text"], [(c["name"], c["arguments"]) for c in r["tool_calls"]]

    ours = {(r["conversation"], r["request"]): answer(r) for r in records if r["server"] == CACHED}
    return [f"{r['conversation']} request {r['request']}" for r in records
            if r["server"] == UNCACHED and ours.get((r["conversation"], r["request"]),
                                                       answer(r)) != answer(r)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from specdecode.bench.serving import MEASURED_MODEL

    parser.add_argument("--model", default=MEASURED_MODEL, help="the GGUF file or named model")
    parser.add_argument("--servers", default=",".join(SERVERS),
                        help=f"comma-separated, of {', '.join(SERVERS)}")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"comma-separated, of {', '.join(WORKLOADS)}")
    parser.add_argument("--mt-bench", type=int, default=3, help="MT-bench conversations")
    parser.add_argument("--max-tokens", type=int, default=96, help="new tokens a request")
    parser.add_argument("--rounds", type=int, default=3,
                        help="requests an agent task may take (the task, then tool results)")
    parser.add_argument("--method", default=None, help="our server's method (default: its own)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=4096, help="positions of each slot")
    parser.add_argument("--llama-cpp", default=None, metavar="DIR",
                        help="the folder of llama.cpp's llama-server")
    parser.add_argument("--out", type=Path, default=Path("bench_out/multiturn"))


def main(argv: list[str] | None = None) -> int:
    from specdecode.bench.cli import gguf_path_for
    from specdecode.bench.serving import machine
    from specdecode.models.loading import load_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    labels = [name.strip() for name in args.servers.split(",") if name.strip()]
    workloads = [name.strip() for name in args.workloads.split(",") if name.strip()]
    for name in labels:
        require(name in SERVERS, f"--servers: no server {name!r}; give some of {', '.join(SERVERS)}")
    for name in workloads:
        require(name in WORKLOADS, f"--workloads: no {name!r}; give some of {', '.join(WORKLOADS)}")
    loaded = load_model(args.model)  # the tokenizer, for the references' token ids
    paths = {"gguf": gguf_path_for(args.model), "log": None,
             "llama": llama_server_binary(args.llama_cpp)
             if any(SERVERS[n][0] == LLAMA_SERVER for n in labels) else None}
    args.out.mkdir(parents=True, exist_ok=True)
    paths["log"] = args.out / "servers.log"
    chats = conversations(workloads, args.mt_bench)
    records: list[dict] = []
    for label in labels:
        records += run_server(label, args, chats, paths,
                              loaded.tokenizer if label == CACHED else None)
    mismatches = compare_answers(records)
    meta = {"model": args.model, "threads": args.threads, "max_tokens": args.max_tokens,
            "cpu": machine()["cpu"], "command": "python scripts/multiturn_bench.py " +
            " ".join(argv if argv is not None else sys.argv[1:])}
    (args.out / "multiturn.json").write_text(json.dumps({"meta": meta, "records": records},
                                                        indent=1))
    (args.out / "multiturn.md").write_text(markdown(meta, records, mismatches))
    print((args.out / "multiturn.md").read_text())
    return 1 if mismatches else 0
