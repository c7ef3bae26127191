"""Two questions about one long text from two `specdecode generate` commands
(``generate --prompt-cache-file``): the text is the first ``--chars`` characters of a
standard-library module (``difflib``), each question after it. The first command reads the
whole prompt and writes its rows to a file; the second, another question about the same text,
reads them back and prefills only its question; then the second again without the file, the
reference. Printed for each: the command's wall seconds, prompt seconds, prompt tokens read
from the file, and whether the answer is the reference's. With a draft model
(``--method draft_model --config draft=qwen2.5-coder-0.5b``) the file keeps the draft's rows
too where the draft read the prompt (the sizing has it read a long prompt only where that pays:
``--draft-budget full`` makes it), and the drafting seconds show what its reading cost.

    python scripts/prompt_cache_generate.py --model qwen2.5-coder-1.5b
"""

from __future__ import annotations

import argparse
import difflib
import inspect
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

QUESTIONS = ("List the public functions this part of the module defines, one a line.",
             "Which class compares two sequences, and what does its ratio() method return?")


def generate(args, prompt: str, cache_file: Path | None) -> tuple[float, dict]:
    command = [sys.executable, "-m", "specdecode", "generate", "-", "--json", "--model",
               args.model, "--max-new-tokens", str(args.max_new_tokens), "--method", args.method]
    for setting in args.config:
        command += ["-c", setting]
    command += ["--draft-budget", args.draft_budget]
    if cache_file is not None:
        command += ["--prompt-cache-file", str(cache_file)]
    started = time.perf_counter()
    done = subprocess.run(command, input=prompt, capture_output=True, text=True, check=True)
    return time.perf_counter() - started, json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--method", default="suffix")
    parser.add_argument("--chars", type=int, default=12000)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                        help="a method config field, as generate's -c (repeatable)")
    parser.add_argument("--draft-budget", default="goodput", choices=("goodput", "full"),
                        help="as generate's (full: a draft model reads the prompt whatever "
                             "it costs, so that the file keeps its rows)")
    args = parser.parse_args()
    text = "Here is a Python module:\n\n" + inspect.getsource(difflib)[:args.chars] + "\n\n"
    with tempfile.TemporaryDirectory() as folder:
        cache_file = Path(folder) / "rows.safetensors"
        runs = [("first question, writes the file", QUESTIONS[0], cache_file),
                ("second question, reads the file", QUESTIONS[1], cache_file),
                ("second question, no file", QUESTIONS[1], None)]
        results = []
        for label, question, path in runs:
            wall, out = generate(args, text + question, path)
            results.append((label, wall, out))
            stats = out["stats"]
            print(f"{label:34s} wall {wall:6.2f} s  prompt {stats['prefill_s']:6.2f} s  "
                  f"drafting {stats['propose_s']:6.2f} s  from the file "
                  f"{stats['cached_tokens']:5d} tokens", flush=True)
        print(f"file: {cache_file.stat().st_size / 1e6:.0f} MB")
    print("second answer with the file = without it:",
          results[1][2]["token_ids"] == results[2][2]["token_ids"])


if __name__ == "__main__":
    main()
