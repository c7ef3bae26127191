"""``specdecode chat``: a conversation in the terminal, each turn prefilling only what is new.

One message a line from standard input (a line ending in a backslash goes on, and the lines
between two lines of three double quotes are one message; ``/reset`` starts a new conversation,
``/exit`` or the end of the input ends it, Ctrl-C ends an answer early; the oldest turns make
room where the conversation outgrows the context); each answer streams to standard output, and
a line of its numbers to standard error: the method's speed, and how many of the turn's prompt
tokens were read and how many kept from the turns before (a ``Decoder`` keeps the
conversation's KV rows on the native runner, so a turn reads only its own message and the
template's tags around it).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from specdecode.cli_options import (add_draft_budget_argument, add_model_arguments,
                                    add_sampling_arguments, load_target, parse_config,
                                    sampling_options)
from specdecode.errors import SpecDecodeError, require


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--method", default=None,
                        help="decoding method (see `specdecode methods`); default: the fastest")
    parser.add_argument("--max-new-tokens", type=int, default=512,
                        help="the longest answer of a turn (default 512)")
    parser.add_argument("--system", default=None, metavar="TEXT",
                        help="a system message at the start of every conversation")
    parser.add_argument("--no-reuse", action="store_true",
                        help="prefill every turn's whole prompt, as without the kept rows "
                             "(to compare)")
    parser.add_argument("-c", "--config", action="append", default=[], metavar="KEY=VALUE",
                        help="method config field (repeatable), e.g. -c num_speculative_tokens=5")
    add_model_arguments(parser)
    add_draft_budget_argument(parser)
    add_sampling_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from specdecode import registry
    from specdecode.api import Decoder

    method = registry.get(args.method or registry.DEFAULT_METHOD)
    config = method.make_config(parse_config(args.config))
    sampling = sampling_options(args)
    require(args.max_new_tokens > 0,
            f"--max-new-tokens must be positive, got {args.max_new_tokens}")
    runner, tokenizer, eos = load_target(args)
    require(getattr(tokenizer, "chat_template", None),
            f"{args.model}'s tokenizer has no chat template to hold a conversation; "
            "use `specdecode generate --no-chat` for plain text")
    decoder = Decoder(runner, tokenizer, method.name, eos, draft_budget=args.draft_budget,
                      reuse_prompt=not args.no_reuse, **dataclasses.asdict(config))
    start = [{"role": "system", "content": args.system}] if args.system else []
    history = list(start)
    for text in _messages():
        if text == "/exit":
            break
        if text == "/reset":
            history = list(start)
        elif text:
            history = _turn(decoder, method.name, history, text, args.max_new_tokens, sampling)
    return 0


def _messages():
    """The user's messages: a line each; a line that ends in a backslash goes on to the next,
    and the lines between two lines of three double quotes are one message (pasted code)."""
    lines = _lines()
    for line in lines:
        text = line.rstrip("\n")
        if text.strip() == '"""':
            block = []
            for more in lines:
                if more.strip() == '"""':
                    break
                block.append(more.rstrip("\n"))
            yield "\n".join(block).strip("\n")
            continue
        while text.endswith("\\") and (more := next(lines, None)) is not None:
            text = text[:-1] + "\n" + more.rstrip("\n")
        yield text.strip()


def _lines():
    """Standard input's lines, with a prompt on standard error where a person types them."""
    while True:
        if sys.stdin.isatty():
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            return
        yield line


def _turn(decoder, name: str, history: list[dict], text: str, max_new_tokens: int,
          sampling: dict) -> list[dict]:
    """One turn: the answer streamed, its numbers on standard error; the history after it (as
    it was where the message does not fit the context)."""
    asked, ids = _fitted(decoder, history, text, max_new_tokens)
    try:
        stream = decoder.stream(ids, max_new_tokens, True, (), **sampling)
    except SpecDecodeError as exc:
        print(f"specdecode: error: {exc}", file=sys.stderr)
        return history
    pieces, interrupted = iter(stream), False
    try:
        for piece in pieces:
            print(piece, end="", flush=True)
    except KeyboardInterrupt:  # Ctrl-C ends this answer, not the conversation
        pieces.close()
        interrupted = True
    print(flush=True)
    if interrupted:
        print("[interrupted]", file=sys.stderr)
    result = stream.result or stream.finish()
    s = result.stats
    read = len(ids) - s.cached_tokens
    print(f"[{name}] {s.new_tokens} tokens, {s.tokens_per_s:.1f} tokens/s, mean accepted "
          f"{s.mean_accepted:.2f}; prompt: {read} tokens read, {s.cached_tokens} kept, "
          f"{s.prefill_s:.2f} s", file=sys.stderr)
    return asked + [{"role": "assistant", "content": result.text}]


def _fitted(decoder, history: list[dict], text: str,
            max_new_tokens: int) -> tuple[list[dict], list[int]]:
    """The turn's messages and their token ids: the history and ``text``, its oldest question
    and answer dropped (a note on standard error) while they leave less than
    ``max_new_tokens`` of the context."""
    first = 1 if history and history[0]["role"] == "system" else 0
    asked = history + [{"role": "user", "content": text}]
    room = decoder.runner.max_context - max_new_tokens
    ids = decoder.encode(asked)
    while len(asked) > first + 1 and len(ids) > room:
        del asked[first:first + 2]
        print("[the oldest turn dropped to fit the context]", file=sys.stderr)
        ids = decoder.encode(asked)
    return asked, ids
