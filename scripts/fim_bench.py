"""Fill in the middle as an editor asks for it, method by method: at cursor positions in a few
files of Python's standard library, the lines before the cursor are the prefix and the lines
after its line the suffix; each method writes the middle (specdecode/fim.py), the methods one
after another at each position. Printed: per method, seconds a request (its prompt included)
and of the prompt alone, the middle's tokens a second after the prompt, tokens a target
forward, how many middles are ``ar``'s token for token, and how many begin with the line that
was at the cursor.

    python scripts/fim_bench.py --model qwen2.5-coder-1.5b --methods ar,suffix,ngram

``--typing N``: instead, an editor's session in the first file: the cursor moves down N code
lines one at a time, the whole file above it the prefix, each contender through the whole
session on its own (``ar`` with every prompt read whole, ``ar`` and ``suffix`` reusing the
rows of the request before: a request after a line was written re-reads the prompt only from
that line on). The files are those of the running Python (their text is its version's: the
report names it).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import platform
import statistics
import time

from specdecode.api import Decoder
from specdecode.bench.cli import parse_methods
from specdecode.cli_options import load_target

#: standard-library modules whose source gives the cursor positions
MODULES = ("textwrap", "shlex", "fnmatch", "ipaddress")


@dataclasses.dataclass
class Case:
    where: str
    prefix: str
    suffix: str
    line: str  # the line at the cursor, which the middle should begin with


def cases(before: int, after: int, every: int, per_file: int) -> list[Case]:
    """Cursor positions at the start of every ``every``-th code line (after ``before`` lines),
    ``per_file`` a module; ``before`` lines of prefix and ``after`` lines of suffix."""
    out = []
    for name in MODULES:
        lines = inspect.getsource(importlib.import_module(name)).splitlines(keepends=True)
        taken = 0
        for i in range(before, len(lines) - after - 1, every):
            if taken == per_file or not lines[i].strip() or lines[i].lstrip().startswith("#"):
                continue
            out.append(Case(f"{name}.py:{i + 1}", "".join(lines[i - before:i]),
                            "".join(lines[i + 1:i + 1 + after]), lines[i].rstrip("\n")))
            taken += 1
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--methods", default="ar,suffix,ngram",
                        help="methods, comma-separated, each with its config (bench's syntax)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--before", type=int, default=40, help="lines of prefix")
    parser.add_argument("--after", type=int, default=20, help="lines of suffix")
    parser.add_argument("--every", type=int, default=23, help="a cursor every this many lines")
    parser.add_argument("--per-file", type=int, default=4, help="cursor positions a file")
    parser.add_argument("--typing", type=int, default=0, metavar="N",
                        help="an editor's session of N cursor lines instead (see above)")
    args = parser.parse_args()
    args.runner, args.weights, args.max_context = "auto", "auto", 4096
    runner, tokenizer, eos = load_target(args)
    if args.typing:
        return typing(args, runner, tokenizer, eos)
    # each method's decoder, ar's first; every prompt prefilled whole (no earlier prompt's rows)
    decoders = {label: Decoder(runner, tokenizer, method.name, eos, reuse_prompt=False,
                               **dataclasses.asdict(config))
                for label, method, config in parse_methods(args.methods, [])}
    todo = cases(args.before, args.after, args.every, args.per_file)
    decoders["ar"].generate(todo[0].prefix, 4, suffix=todo[0].suffix)  # warm-up
    rows = {label: [] for label in decoders}
    for case in todo:
        for label, decoder in decoders.items():
            start = time.perf_counter()
            result = decoder.generate(case.prefix, args.max_new_tokens, suffix=case.suffix)
            wall = time.perf_counter() - start
            first = result.text.split("\n", 1)[0].strip()
            reference = result if label == "ar" else rows["ar"][-1][0]  # ar runs first
            rows[label].append((result, wall, result.token_ids == reference.token_ids,
                                first == case.line.strip()))
    report(args, todo, rows)
    return 0


def typing(args, runner, tokenizer, eos) -> int:
    lines = inspect.getsource(importlib.import_module(MODULES[0])).splitlines(keepends=True)
    cursors = [i for i in range(args.before, len(lines) - args.after - 1)
               if lines[i].strip() and not lines[i].lstrip().startswith("#")][:args.typing]
    print(f"Model `{args.model}`, an editor's session in {MODULES[0]}.py (Python "
          f"{platform.python_version()}): the cursor at lines {cursors[0] + 1}-{cursors[-1] + 1} "
          f"({len(cursors)} code lines), the file above it the prefix, {args.after} lines after "
          f"it the suffix, at most {args.max_new_tokens} tokens, greedy.\n")
    print("| contender | s a request (median) | prompt s (median) | prompt tokens (median) | "
          "of them reused (median) | the cold `ar`'s middle |")
    print("|---|---:|---:|---:|---:|---:|")
    cold = None
    for label, name, reuse in (("ar, every prompt read whole", "ar", False),
                               ("ar, the prompt reused", "ar", True),
                               ("suffix, the prompt reused", "suffix", True)):
        decoder = Decoder(runner, tokenizer, name, eos, reuse_prompt=reuse)
        decoder.generate("x = 1\n", 4, suffix="\n")  # the runner's cache holds another text
        walls, results = [], []
        for i in cursors:
            start = time.perf_counter()
            results.append(decoder.generate("".join(lines[:i]), args.max_new_tokens,
                                            suffix="".join(lines[i + 1:i + 1 + args.after])))
            walls.append(time.perf_counter() - start)
        prompts = [len(decoder.fill_in("".join(lines[:i]), "".join(
            lines[i + 1:i + 1 + args.after]))[0]) for i in cursors]
        cold = cold or [r.token_ids for r in results]
        same = sum(r.token_ids == c for r, c in zip(results, cold))
        print(f"| {label} | {statistics.median(walls):.2f} | "
              f"{statistics.median(r.stats.prefill_s for r in results):.2f} | "
              f"{statistics.median(prompts):.0f} | "
              f"{statistics.median(r.stats.cached_tokens for r in results):.0f} | "
              f"{same}/{len(results)} |")
    return 0


def report(args, todo: list[Case], rows: dict) -> None:
    print(f"Model `{args.model}`, {len(todo)} cursor positions in {', '.join(MODULES)} "
          f"(Python {platform.python_version()}), {args.before} lines before and {args.after} "
          f"after, at most {args.max_new_tokens} tokens, greedy.\n")
    print("| method | s a request (median) | prompt s (median) | tokens/s after the prompt | "
          "tokens a forward | ar's middle | begins with the line |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label, entries in rows.items():
        prompt = [r.stats.prefill_s for r, *_ in entries]
        after = sum(wall for _, wall, *_ in entries) - sum(prompt)
        tokens = sum(len(r.token_ids) for r, *_ in entries)
        forwards = sum(r.stats.target_forwards for r, *_ in entries)
        print(f"| {label} | {statistics.median(wall for _, wall, *_ in entries):.2f} | "
              f"{statistics.median(prompt):.2f} | {(tokens - len(entries)) / after:.1f} | "
              f"{tokens / forwards:.2f} | {sum(same for *_, same, _ in entries)}/{len(entries)} "
              f"| {sum(hit for *_, hit in entries)}/{len(entries)} |")


if __name__ == "__main__":
    raise SystemExit(main())
