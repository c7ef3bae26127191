"""The native runner's kernels at a git revision against the working tree's, in one process.

    PYTHONPATH=src python scripts/kernels_ab.py --rev 68c82f5
    PYTHONPATH=src python scripts/kernels_ab.py --rev HEAD~1 --pasts 300 --rows 1 --prefill

A shared machine's speed drifts by tens of percent within minutes, so timings taken one run
after another compare the hour, not the code. Here both builds live in one process: the
revision's kernel sources (``git show REV:src/specdecode/kernels/...``) are built as an
extension of their own beside the working tree's, one runner of ``--model`` (the default model;
native, its default weights or ``--weights``) is built on each (``kernels.load`` pointed at its
build while it is built and called), and the
two take turns call by call, each first in every other turn. Reported: the median of each,
for a forward of ``rows`` rows after ``past`` cached positions (equal logits asserted) and,
with ``--prefill``, prompts of ``--prefill-lengths`` tokens, and the working tree's time
against the revision's both as the ratio of the medians and as the median of each turn's
ratio. The Python side is the working tree's for both, so a revision whose extension takes
other arguments cannot be compared.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from specdecode import kernels
from specdecode.draft import Draft
from specdecode.models.loading import load_model, make_runner

def build_revision(rev: str, folder: Path):
    """The kernels extension built from revision ``rev``'s sources (the working tree's source
    list; a header the revision lacks is one its kernels do not include)."""
    paths = []
    for name in (path.name for path in kernels._SOURCES):
        shown = subprocess.run(["git", "show", f"{rev}:src/specdecode/kernels/{name}"],
                               capture_output=True, text=True)
        if shown.returncode == 0:
            (folder / name).write_text(shown.stdout)
            paths.append(folder / name)
    return kernels.compile_extension("kernels_at_revision", paths)


def tokens(count: int) -> list[int]:
    """``count`` token ids spread over the vocabulary (a prompt whose content does not matter)."""
    return [1000 + (i * 7919) % 40000 for i in range(count)]


def alternate(calls: dict, turns: int) -> dict:
    """{name: seconds of each turn} of ``calls`` taking turns, each first in every other turn."""
    times = {name: [] for name in calls}
    for turn in range(turns):
        for name in sorted(calls, reverse=turn % 2 == 1):
            start = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - start)
    return times


def medians(times: dict) -> dict:
    """{name: median seconds} of alternate's times."""
    return {name: statistics.median(t) for name, t in times.items()}


def compared(times: dict, digits: int) -> str:
    """The two builds' median times (ms) and the tree's against the revision's: the ratio of
    the medians and the median of each turn's ratio, which a slow spell of the machine that
    outlasts a turn moves less."""
    rev, tree = statistics.median(times["rev"]), statistics.median(times["tree"])
    paired = statistics.median(t / r for t, r in zip(times["tree"], times["rev"]))
    return (f"{rev * 1e3:.{digits}f} / {tree * 1e3:.{digits}f} ({tree / rev:.3f}x, "
            f"turn by turn {paired:.3f}x)")


def forward_times(runners: dict, rows: int, turns: int, use=lambda name: None,
                  equal: bool = True) -> dict:
    """{name: seconds of each turn} of a forward of ``rows`` rows (a root and a chain, not
    committed) by each of ``runners`` in turns (``use(name)`` before each), their logits
    asserted equal (``equal``; False where the runners hold layouts of different numbers)."""
    logits = {}

    def step(name):
        use(name)
        logits[name] = runners[name].forward(0, Draft.chain([5] * (rows - 1))).logits
        runners[name].commit([])

    took = alternate({name: lambda name=name: step(name) for name in runners}, turns)
    first, *others = logits.values()
    assert not equal or all(torch.equal(first, other) for other in others), "the logits differ"
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", required=True, help="the git revision to compare against")
    parser.add_argument("--pasts", type=int, nargs="+", default=[100, 300, 800, 1600])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--model", default="smollm2", help="a model name or GGUF file")
    parser.add_argument("--weights", default="auto", help="the native runner's weight format")
    parser.add_argument("--prefill", action="store_true", help="also time prompts")
    parser.add_argument("--prefill-lengths", type=int, nargs="+", default=[100, 768])
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as folder:
        builds = {"rev": build_revision(args.rev, Path(folder)), "tree": kernels.load()}
    loaded = load_model(args.model)

    def use(name: str):
        kernels.load = lambda ext=builds[name]: ext

    base = {}
    # room for the longest past and its rows, and for the prompts
    context = max(max(args.pasts) + max(args.rows), max(args.prefill_lengths)) + 64
    for name in builds:
        use(name)
        base[name] = make_runner(loaded, "native", args.weights, context)
    print(f"ms, {args.rev} / working tree ({torch.get_num_threads()} threads)")
    for past in args.pasts:
        prompt = tokens(past)
        runners = {name: base[name].replica() for name in builds}
        for name, runner in runners.items():
            use(name)
            runner.prefill(prompt)
        for m in args.rows:
            took = forward_times(runners, m, args.turns, use)
            print(f"forward {m} rows after {past}: {compared(took, 2)}", flush=True)
    if args.prefill:
        for length in args.prefill_lengths:
            prompt = tokens(length)

            def fill(name, prompt=prompt):
                use(name)
                base[name].replica().prefill(prompt)

            took = alternate({name: lambda name=name: fill(name) for name in builds},
                             max(4, args.turns // 4))
            print(f"prefill {length}: {compared(took, 1)}", flush=True)


if __name__ == "__main__":
    main()
